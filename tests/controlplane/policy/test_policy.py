from __future__ import annotations

import pytest

from common.policy_schema import KNOBS, PolicyError, PolicyKnobs
from controlplane.policy import services
from controlplane.policy.models import KNOB_NAMES, SchedulingPolicy


def test_model_fields_and_the_shared_schema_agree(db) -> None:
    policy = services.ensure_default_policy()
    assert policy.knobs() == PolicyKnobs().as_dict()
    assert set(KNOB_NAMES) == {k.name for k in KNOBS}


def test_each_change_is_a_revision_with_who_when_and_why(admin_user) -> None:
    policy = services.ensure_default_policy()
    revision = services.update_policy(
        policy, changes={"cpu_max_batch_size": 4}, acting_user=admin_user, reason="fewer CPU seqs"
    )
    assert revision.version == 2
    assert revision.changed == {"cpu_max_batch_size": [8, 4]}
    assert revision.created_by == admin_user
    assert revision.reason == "fewer CPU seqs"
    assert SchedulingPolicy.objects.get(name="default").version == 2


def test_rollback_restores_an_earlier_revision_as_a_new_one(admin_user) -> None:
    policy = services.ensure_default_policy()
    services.update_policy(policy, changes={"mode": "gpu-only"}, acting_user=admin_user, reason="a")
    services.update_policy(
        policy, changes={"gpu_cache_threshold": 70}, acting_user=admin_user, reason="b"
    )
    revision = services.rollback_policy(policy, to_version=1, acting_user=admin_user)
    policy.refresh_from_db()
    assert (policy.version, policy.mode, policy.gpu_cache_threshold) == (4, "auto", 90.0)
    assert revision.rolled_back_to == 1
    assert [r.version for r in policy.revisions.all()] == [4, 3, 2, 1]


def test_a_change_without_reason_or_without_effect_is_refused(admin_user) -> None:
    policy = services.ensure_default_policy()
    with pytest.raises(PolicyError, match="reason"):
        services.update_policy(
            policy, changes={"mode": "cpu-only"}, acting_user=admin_user, reason=" "
        )
    with pytest.raises(PolicyError, match="current value"):
        services.update_policy(policy, changes={"mode": "auto"}, acting_user=admin_user, reason="x")


@pytest.mark.parametrize(
    ("change", "field", "fragment"),
    [
        ({"gpu_cache_threshold": 120}, "gpu_cache_threshold", "at most 100"),
        ({"cpu_max_batch_size": -1}, "cpu_max_batch_size", "at least 0"),
        ({"mode": "fastest"}, "mode", "one of auto, gpu-only, cpu-only, forced-pd"),
        (
            {"token_limit_min": 500},
            "token_limit_min",
            "must not exceed token_limit_max (500 > 100)",
        ),
        ({"enable_auto_pd_offload": "maybe"}, "enable_auto_pd_offload", "true or false"),
        ({"metrics_interval": 1}, "metrics_interval", "unknown field"),
    ],
)
def test_bad_knobs_get_a_400_naming_the_field_and_limit(
    admin_client, change, field, fragment
) -> None:
    response = admin_client.patch(
        "/api/v1/policies/default/", {**change, "reason": "t"}, format="json"
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["message"].startswith(field)
    assert fragment in error["message"]


def test_routers_get_an_etag_and_a_304_when_nothing_changed(admin_client, router_client) -> None:
    first = router_client.get("/api/v1/routing/policies/default")
    assert first.status_code == 200
    etag = first["ETag"]
    assert first.json()["knobs"]["cpu_max_batch_size"] == 8
    unchanged = router_client.get("/api/v1/routing/policies/default", HTTP_IF_NONE_MATCH=etag)
    assert unchanged.status_code == 304
    assert unchanged.content == b""
    admin_client.patch(
        "/api/v1/policies/default/", {"cpu_max_batch_size": 2, "reason": "t"}, format="json"
    )
    changed = router_client.get("/api/v1/routing/policies/default", HTTP_IF_NONE_MATCH=etag)
    assert changed.status_code == 200
    assert changed["ETag"] != etag
    assert changed.json()["version"] == 2
    assert changed.json()["knobs"]["cpu_max_batch_size"] == 2


def test_a_conditional_get_with_nothing_new_costs_one_query(
    router_client, django_assert_max_num_queries
) -> None:
    etag = router_client.get("/api/v1/routing/policies/default")["ETag"]
    # One query authenticates the token, one reads the policy's version.
    with django_assert_max_num_queries(2):
        assert (
            router_client.get(
                "/api/v1/routing/policies/default", HTTP_IF_NONE_MATCH=etag
            ).status_code
            == 304
        )


def test_revision_history_and_rollback_over_the_api(admin_client) -> None:
    admin_client.patch(
        "/api/v1/policies/default/", {"mode": "forced-pd", "reason": "try PD"}, format="json"
    )
    history = admin_client.get("/api/v1/policies/default/revisions").json()["results"]
    assert [(r["version"], r["reason"]) for r in history] == [
        (2, "try PD"),
        (1, "initial defaults (sysHAX example configuration)"),
    ]
    assert history[0]["changed"] == {"mode": ["auto", "forced-pd"]}
    response = admin_client.post("/api/v1/policies/default/rollback", {"version": 1}, format="json")
    assert response.status_code == 200
    assert (response.json()["mode"], response.json()["version"]) == ("auto", 3)
    missing = admin_client.post("/api/v1/policies/default/rollback", {"version": 42}, format="json")
    assert missing.status_code == 400
    assert "no revision 42" in missing.json()["error"]["message"]


def test_a_change_that_is_not_an_object_is_a_400(admin_client) -> None:
    response = admin_client.patch("/api/v1/policies/default/", [1, 2], format="json")
    assert response.status_code == 400
    assert "JSON object" in response.json()["error"]["message"]
