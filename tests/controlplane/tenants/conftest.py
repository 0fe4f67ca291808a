"""Fixtures of the tenants' tests: one object each."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.access.models import MachineCredential
from controlplane.routers.models import RouterInstance
from controlplane.tenants import services
from controlplane.tenants.models import Tenant


@pytest.fixture
def make_tenant(db: Any):
    def make(name: str = "acme", **values: Any) -> Tenant:
        return services.save_tenant(None, {"name": name, **values}, acting_user="test")

    return make


@pytest.fixture
def tenant(make_tenant) -> Tenant:
    return make_tenant("acme", rpm_limit=600, tpm_limit=200_000, classes=["standard", "batch"])


@pytest.fixture
def router_instance(router_token: str) -> RouterInstance:
    """The registered router of ``router_client``'s credential."""
    credential = MachineCredential.objects.get(kind="router", name="router-a")
    return RouterInstance.objects.create(name="router-a", credential=credential)


@pytest.fixture
def other_router(db: Any) -> RouterInstance:
    credential, _ = MachineCredential.issue("router", "router-b")
    return RouterInstance.objects.create(name="router-b", credential=credential)
