"""A profile changed through the REST API leaves the same audit row as through the dashboard
(``deployments.services.save_profile``), and the names the dashboard's pages use are refused."""

from __future__ import annotations

from controlplane.core.models import AuditEntry
from controlplane.deployments.models import DeploymentProfile


def test_the_api_writes_an_audit_row_for_a_created_and_a_changed_profile(
    admin_client, admin_user
) -> None:
    created = admin_client.post(
        "/api/v1/profiles/", {"name": "p", "model": "m", "gpu_port": 7101}, format="json"
    )
    assert created.status_code == 201, created.content
    profile = DeploymentProfile.objects.get(name="p")
    (row,) = AuditEntry.objects.filter(action="profile.created", object_id=str(profile.pk))
    assert row.actor == admin_user and row.detail["name"] == "p"

    changed = admin_client.patch(
        f"/api/v1/profiles/{profile.pk}/", {"gpu_port": 7201, "model": "m"}, format="json"
    )
    assert changed.status_code == 200, changed.content
    assert changed.json()["gpu_port"] == 7201
    (row,) = AuditEntry.objects.filter(action="profile.updated", object_id=str(profile.pk))
    assert row.detail["fields"] == ["gpu_port"]  # the model did not change: not listed
    profile.refresh_from_db()
    assert profile.gpu_port == 7201


def test_a_profile_may_not_take_a_name_the_dashboard_uses(admin_client) -> None:
    refused = admin_client.post("/api/v1/profiles/", {"name": "new", "model": "m"}, format="json")
    assert refused.status_code == 400
    assert "'new' is reserved" in str(refused.json()["error"]["fields"]["name"])
    assert not DeploymentProfile.objects.filter(name="new").exists()
