"""Schemathesis drives every operation of the published OpenAPI schema: no input may make a 5xx,
and every answer must match the schema (documented status, content type, headers, body).

Two of its checks are left out, for reasons decision 17 gives: ``positive_data_acceptance``
(a schema-valid request must succeed: not so for a reference to an object that does not exist,
or a rule the schema cannot state, which get a 400 naming the field) and
``negative_data_rejection`` (a schema-violating request must fail: DRF accepts ``"1"`` for an
integer and ignores unknown query parameters, as clients expect of it).

Path parameters name real objects (a node with its card, a profile, a deployment with a
container and a command, a router, a benchmark run), so the examples reach the code behind the
404. Machine endpoints get the machine's own token; the rest an admin's API token. Bounded:
``FUZZ_EXAMPLES`` examples per operation, derandomized so a failure reproduces.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, settings
from schemathesis.checks import negative_data_rejection, positive_data_acceptance

from controlplane.access.models import MachineCredential, PersonalToken
from controlplane.benchmarks.models import BenchmarkRun, Scenario
from controlplane.deployments.models import AgentCommand, ContainerInstance
from controlplane.routers.models import RouterInstance
from controlplane.tenants.services import save_tenant
from controlplane.wsgi import application
from testbed.factories import build_deployment, build_node, build_profile

pytestmark = pytest.mark.slow  # hypothesis and schemathesis: a minute of CPU in one test

FUZZ_EXAMPLES = int(os.environ.get("SYSHAX_FUZZ_EXAMPLES", "15"))
schema = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))
schema.app = application

AGENT_PATHS = ("/api/v1/agent/", "/api/v1/commands/{dispatch_id}/result")
AGENT_NODE_PATHS = ("heartbeat", "inventory", "containers")
ROUTER_PATHS = (
    "/api/v1/routers/register",
    "/api/v1/routers/{id}/stats",
    "/api/v1/routers/{id}/usage",
    "/api/v1/routing/",
)


@dataclass
class World:
    admin: str
    agent: str
    router: str
    ids: dict[str, Any]  # path prefix -> the real object's id

    def authorization(self, path: str) -> str:
        if path.startswith(AGENT_PATHS) or (
            path.startswith("/api/v1/nodes/{id}/") and path.rstrip("/").endswith(AGENT_NODE_PATHS)
        ):
            return f"Bearer {self.agent}"
        if path.startswith(ROUTER_PATHS):
            return f"Bearer {self.router}"
        return f"Token {self.admin}"

    def real_parameters(self, path: str, given: dict[str, Any]) -> dict[str, Any]:
        prefix = path.split("{", 1)[0]
        return {**given, **{k: self.ids[prefix] for k in given if prefix in self.ids}}


@pytest.fixture
def world(db: Any, admin_user) -> Iterator[World]:
    # As Django's test client does: the test's transaction must outlive each request.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    node = build_node("fuzz-node")
    profile = build_profile(name="fuzz-profile")
    deployment = build_deployment(node, profile, name="fuzz-dep")
    container = ContainerInstance.objects.create(
        deployment=deployment, role="gpu", generation=1, engine_id="e1", name="fuzz-gpu"
    )
    command = AgentCommand.objects.create(
        dispatch_id=uuid.uuid4(), node=node, deployment=deployment, action="start", role="gpu"
    )
    agent_credential, agent = MachineCredential.issue("agent", "fuzz-agent", node=node)
    router_credential, router = MachineCredential.issue("router", "fuzz-router")
    instance = RouterInstance.objects.create(name="fuzz-router", credential=router_credential)
    scenario = Scenario.objects.order_by("pk").first() or Scenario.objects.create(name="fuzz")
    run = BenchmarkRun.objects.create(scenario=scenario, deployment=deployment)
    tenant = save_tenant(None, {"name": "fuzz-tenant"}, acting_user=admin_user)
    ids = {
        "/api/v1/nodes/": node.pk,
        "/api/v1/accelerators/": node.accelerators.first().pk,
        "/api/v1/profiles/": profile.pk,
        "/api/v1/deployments/": deployment.pk,
        "/api/v1/containers/": container.pk,
        "/api/v1/commands/": str(command.dispatch_id),
        "/api/v1/credentials/": agent_credential.pk,
        "/api/v1/routers/": instance.pk,
        "/api/v1/policies/": "default",
        "/api/v1/routing/policies/": "default",
        "/api/v1/scenarios/": scenario.name,
        "/api/v1/benchmark-runs/": run.pk,
        "/api/v1/tenants/": tenant.name,
    }
    yield World(PersonalToken.issue(admin_user, "fuzz")[1], agent, router, ids)
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
def test_no_input_makes_a_server_error_or_breaks_the_schema(case, world: World) -> None:
    if case.path_parameters:
        case.path_parameters = world.real_parameters(case.path, case.path_parameters)
    case.call_and_validate(
        headers={"Authorization": world.authorization(case.path)},
        excluded_checks=[positive_data_acceptance, negative_data_rejection],
    )
