"""Managed mode against the real control plane: pull, live change, stats, outage, restart."""

from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_procs import MODEL, ROOT, Proc, metric, wait_for
from test_router_paths import stream_chat

from tests.support.controlplane import free_port, running, syshax, wait_until

pytestmark = pytest.mark.process  # routers and stand-in engines as processes


def start_managed(
    workdir: Path, name: str, control_plane: str, token: str, state_dir: Path
) -> Proc:
    return Proc(
        name,
        [
            "router",
            "--control-plane",
            control_plane,
            "--token",
            token,
            "--name",
            "router-a",
            "--state-dir",
            str(state_dir),
            "--poll-interval",
            "0.25",
            "--stats-interval",
            "0.5",
        ],
        workdir,
    )


class ControlPlane:
    """A real control plane (gunicorn + Django) on its own throw-away SQLite database.

    Its own database keeps this test independent of pytest-django's test database; the
    rows are written with ``syshax manage shell`` in a separate process, as an operator would.
    """

    def __init__(self, tmp: Path) -> None:
        self.env = {
            **os.environ,
            "DATABASE_URL": f"sqlite:///{tmp / 'cp.sqlite3'}",
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
            "SYSHAX_VAR_DIR": str(tmp),
            "PYTHONUNBUFFERED": "1",
        }
        self.manage("migrate", "-v", "0")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stack = ExitStack()
        self.stack.enter_context(
            running(
                syshax(
                    "web",
                    "--bind",
                    f"127.0.0.1:{self.port}",
                    "--no-migrate",
                    "--workers",
                    "1",
                    "--threads",
                    "4",
                ),
                tmp / "web.log",
                env=self.env,
            )
        )
        wait_until(self.answering, 60, "the control plane web process")

    def answering(self) -> bool:
        try:
            return httpx.get(self.url + "/api/v1/routing/deployments", timeout=2).status_code == 401
        except httpx.HTTPError:
            return False

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            syshax("manage", *args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    def shell(self, code: str) -> str:
        return self.manage("shell", "-c", code).splitlines()[-1]

    def stop(self) -> None:
        self.stack.close()


SETUP = """
from controlplane.access.models import MachineCredential
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.inventory.models import Node
from controlplane.policy.services import ensure_default_policy, update_policy
policy = ensure_default_policy()
update_policy(policy, changes={{"mode": "gpu-only"}}, acting_user=None, reason="test start")
profile = DeploymentProfile.objects.create(
    name="sim-profile", model="deepseek-r1-distill-qwen-32b", served_model_name="{model}",
    engine="simulator")
node = Node.objects.create(name="node-a", address="127.0.0.1")
Deployment.objects.create(name="dep-a", profile=profile, node=node, policy=policy,
    state="running", gpu_endpoint="{gpu}", cpu_endpoint="{cpu}")
print(MachineCredential.issue("router", "router-a")[1])
"""

SET_MODE = """
from controlplane.policy.services import ensure_default_policy, update_policy
update_policy(ensure_default_policy(), changes={{"mode": "{mode}"}}, acting_user=None,
              reason="router test")
print(ensure_default_policy().version)
"""

# Written straight to the row, past the control plane's validation: max_num_seqs 0 is below
# the schema's minimum, so the router must refuse it.
CORRUPT = """
from django.db.models import F
from controlplane.policy.models import SchedulingPolicy
SchedulingPolicy.objects.filter(name="default").update(
    max_num_seqs=0, mode="gpu-only", version=F("version") + 1)
print("ok")
"""

ROUTER_ROW = """
import json
from controlplane.routers.models import RouterInstance

row = RouterInstance.objects.filter(name="router-a").first()
print(json.dumps(row and {"stats": row.stats, "policy_version": row.policy_version,
                          "listen_url": row.listen_url}))
"""


def test_managed_router_follows_the_control_plane_and_survives_its_outage(
    engines: tuple[Proc, Proc], workdir: Path, tmp_path: Path
) -> None:
    gpu, cpu = engines
    cp = ControlPlane(tmp_path)
    procs: list[Proc] = []
    try:
        token = cp.shell(SETUP.format(model=MODEL, gpu=gpu.url, cpu=cpu.url))
        state_dir = tmp_path / "state"
        router = start_managed(workdir, "managed", cp.url, token, state_dir)
        procs.append(router)
        wait_for(lambda: router.get("/v1/models").json()["data"], timeout=5)
        assert stream_chat(router, 3)[0] == "gpu-only"

        # A policy change lands within a second, without a restart.
        good_version = int(cp.shell(SET_MODE.format(mode="forced-pd")))
        changed = time.monotonic()
        wait_for(
            lambda: router.get("/health").json()["mode"] == "forced-pd", timeout=1.0, interval=0.02
        )
        assert time.monotonic() - changed <= 1.0
        assert router.get("/health").json()["policy_version"] == good_version
        assert stream_chat(router, 3)[0] == "pd"

        # It reports its stats.
        def reported() -> Any:
            row = json.loads(cp.shell(ROUTER_ROW))
            return row if row and (row["stats"] or {}).get("decisions", {}).get("pd") else None

        row = wait_for(reported, timeout=10, interval=0.3)
        assert row["policy_version"] == good_version
        assert row["listen_url"] == router.url

        # A policy the schema refuses is logged and not applied.
        cp.shell(CORRUPT)
        wait_for(lambda: metric(router, "syshax_router_policy_rejections_total") == 1, timeout=2)
        health = router.get("/health").json()
        assert (health["mode"], health["policy_version"]) == ("forced-pd", good_version)
        assert "max_num_seqs: must be at least 1" in router.log_text()

        # The control plane goes down: the router keeps serving ...
        cp.stop()
        time.sleep(0.6)
        assert stream_chat(router, 3)[0] == "pd"
        # ... and across its own restart, from the last good state on disk.
        router.stop()
        restarted = start_managed(workdir, "managed2", cp.url, token, state_dir)
        procs.append(restarted)
        assert [m["id"] for m in restarted.get("/v1/models").json()["data"]] == [MODEL]
        assert restarted.get("/health").json()["policy_version"] == good_version
        assert stream_chat(restarted, 3)[0] == "pd"
    finally:
        for proc in procs:
            proc.stop()
        cp.stop()


def test_state_cache_restores_only_valid_state(tmp_path: Path) -> None:
    """The on-disk copy is validated like a fresh pull before it is applied."""
    import asyncio

    from common.policy_schema import PolicyKnobs
    from router.policy.managed import ControlPlaneClient, StateCache
    from router.state import Router, ServerConfig

    good = {
        "name": "default",
        "version": 4,
        "knobs": dict(PolicyKnobs().as_dict(), mode="cpu-only"),
    }
    bad = {"name": "fast", "version": 9, "knobs": dict(PolicyKnobs().as_dict(), max_num_seqs=0)}
    StateCache(tmp_path).save(
        {
            "router_id": 3,
            "policies": {"default": good, "fast": bad},
            "deployments": [
                {
                    "id": 1,
                    "name": "d",
                    "model": "m",
                    "policy": "default",
                    "pd_protocol": "syshax",
                    "gpu_url": "http://127.0.0.1:9",
                    "cpu_url": None,
                }
            ],
        }
    )

    async def restore() -> Router:
        router = Router(ServerConfig())
        client = ControlPlaneClient(
            router,
            base_url="http://127.0.0.1:9",
            token="t",
            name="r",
            listen_url="",
            state_dir=tmp_path,
        )
        assert client.restore()
        await router.state.close()
        return router

    router = asyncio.run(restore())
    assert router.state.default_policy().version == 4
    assert router.state.default_policy().knobs.mode == "cpu-only"
    assert "fast" not in router.state.policies
    assert list(router.state.by_model) == ["m"]
    (tmp_path / "router-state.json").write_text("{garbage")
    assert StateCache(tmp_path).load() is None
