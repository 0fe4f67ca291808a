"""A router credential is not every tenant: on the Batch API a router token acts only for the
router's own callers (router-key, anonymous); a tenant's requests carry the tenant's own key
(docs/decisions/0057-router-credential-scope-and-usage-bounds.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from controlplane.access.models import MachineCredential
from controlplane.batches import services
from controlplane.batches.auth import Caller
from controlplane.batches.models import Batch, BatchFile
from controlplane.tenants.models import Tenant
from controlplane.tenants.services import issue_key

LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "tiny", "messages": [{"role": "user", "content": "private"}]},
}


@pytest.fixture
def acme(db: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr("controlplane.batches.services.enqueue", lambda *args: None)
    tenant = Tenant.objects.create(name="acme")
    _, key = issue_key(tenant, acting_user=None)
    caller = Caller("acme", tenant)
    content = (json.dumps(LINE) + "\n").encode()
    source = services.create_file(
        caller, filename="in.jsonl", purpose="batch", size=len(content), pieces=[content]
    )
    batch = services.create_batch(
        caller, input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return {"key": key, "file": source.id, "batch": batch.id}


@pytest.fixture
def second_router(db: Any) -> str:
    return MachineCredential.issue("router", "router-b")[1]


def as_router(token: str, tenant: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}", "HTTP_X_SYSHAX_TENANT": tenant}


def refused(response: Any) -> bool:
    error = response.json()["error"]
    return (
        response.status_code == 403
        and error["code"] == "tenant_needs_own_key"
        and "its own key" in error["message"]
    )


def test_a_router_token_cannot_act_as_a_tenant(acme, second_router) -> None:
    client = Client()
    headers = as_router(second_router, "acme")
    files, batches = BatchFile.objects.count(), Batch.objects.count()
    upload = {"purpose": "batch", "file": ("x.jsonl", json.dumps(LINE).encode())}
    attempts = [
        client.get("/v1/files", **headers),
        client.get(f"/v1/files/{acme['file']}", **headers),
        client.get(f"/v1/files/{acme['file']}/content", **headers),
        client.delete(f"/v1/files/{acme['file']}", **headers),
        client.post("/v1/files", upload, **headers),
        client.get("/v1/batches", **headers),
        client.get(f"/v1/batches/{acme['batch']}", **headers),
        client.post(
            "/v1/batches",
            {
                "input_file_id": acme["file"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
            content_type="application/json",
            **headers,
        ),
        client.post(f"/v1/batches/{acme['batch']}/cancel", **headers),
    ]
    assert all(refused(r) for r in attempts), [(r.status_code, r.content) for r in attempts]
    assert (BatchFile.objects.count(), Batch.objects.count()) == (files, batches)
    assert Batch.objects.get(pk=acme["batch"]).status != "cancelling"

    own = {"HTTP_AUTHORIZATION": f"Bearer {acme['key']}"}
    assert client.get(f"/v1/files/{acme['file']}", **own).status_code == 200
    assert client.get(f"/v1/batches/{acme['batch']}", **own).status_code == 200
    listed = client.get("/v1/files", **own).json()["data"]
    assert [f["id"] for f in listed] == [acme["file"]]


@pytest.mark.parametrize("owner", ["router-key", "anonymous"])
def test_a_router_token_still_acts_for_its_own_callers(acme, second_router, owner) -> None:
    answer = Client().get("/v1/files", **as_router(second_router, owner))
    assert answer.status_code == 200 and answer.json()["data"] == []  # not acme's
