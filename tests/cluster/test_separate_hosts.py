"""Three nodes, a router and the control plane, each a separate host on a private network
(Linux network namespaces on a bridge, tests/support/netns.py). Nothing crosses between them
but TCP on that network: agents register and heartbeat over it, the engines they start
listen on their own machine's address, and the router reaches them there.

One node's machine is lost (everything on it killed, its namespace deleted): after the grace
period it is offline, its deployment unknown, and the router serves from the other two with
no client error (before it has dropped the lost engine, a request on that engine as it dies
moves to another replica). The machine comes back with the same address: online again, nothing
registered or started twice, and once redeployed its engine serves again.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from itertools import pairwise

import httpx
import pytest
from django.utils import timezone

from controlplane.deployments import services
from controlplane.deployments.models import (
    AgentCommand,
    ContainerInstance,
    Deployment,
    DeploymentProfile,
)
from controlplane.inventory.models import Heartbeat, Node
from tests.cluster.fleet import ClusterNode, ClusterRouter, Fleet
from tests.support.controlplane import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.django_db(transaction=True)]

MODEL = "qwen2.5-7b-instruct"
ENGINE_PORT = 7001  # the same on every node: each is a machine of its own
PROMPT = "Separate hosts share nothing but the network. " * 4


def make_profile() -> DeploymentProfile:
    sim = [sys.executable, "-m", "syshax.cli", "sim"]
    return DeploymentProfile.objects.create(
        name="cluster-sim",
        model=MODEL,
        engine="simulator",
        sim_gpu_device="a100-80gb",
        quantization="none",
        enable_cpu_engine=False,
        gpu_command=sim,
        gpu_port=ENGINE_PORT,
        # The control plane passes the simulator `--host <node address>` (it binds 127.0.0.1
        # by default), so the engine listens where the agent checks and the router calls.
        gpu_extra_args=["--speed", "20"],
        max_model_len=4096,
        health_timeout_seconds=30,
    )


def state(deployment: Deployment) -> str:
    return str(Deployment.objects.get(pk=deployment.pk).state)


def served(node: ClusterNode) -> int:
    """Requests the node's engine finished, from its own /metrics (read from the host side)."""
    text = httpx.get(f"http://{node.host.address}:{ENGINE_PORT}/metrics", timeout=5).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )
    )


def complete(url: str, client: httpx.Client) -> str:
    """One completion through the router: "ok", or what went wrong."""
    try:
        r = client.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 24},
            timeout=30,
        )
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return "ok" if r.status_code == 200 and r.json()["choices"][0]["text"] else str(r.status_code)


def burst(url: str, requests: int, concurrency: int = 6) -> Counter[str]:
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        return Counter(pool.map(lambda _: complete(url, client), range(requests)))


class Load:
    """Clients sending completions until stopped, each outcome stamped with its time."""

    def __init__(self, url: str, clients: int = 3) -> None:
        self.url = url
        self.outcomes: list[tuple[float, float, str]] = []  # (sent, answered, outcome)
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        with httpx.Client() as client:
            while not self.stopping.is_set():
                sent = time.monotonic()
                outcome = complete(self.url, client)
                self.outcomes.append((sent, time.monotonic(), outcome))

    def stop(self) -> list[tuple[float, float, str]]:
        self.stopping.set()
        for t in self.threads:
            t.join(40)
        return self.outcomes


def heartbeat_gap(node: ClusterNode, around: datetime) -> float:
    """The longest silence, in seconds, between ``node``'s heartbeats from 2 s before
    ``around`` until now."""
    times = sorted(
        Heartbeat.objects.filter(
            node_id=node.pk, received_at__gte=around - timedelta(seconds=2)
        ).values_list("received_at", flat=True)
    )
    times.append(timezone.now())
    return round(max((b - a).total_seconds() for a, b in pairwise(times)), 2)


def one_engine_per_role(node: ClusterNode) -> dict[tuple[str, str], int]:
    counts: Counter[tuple[str, str]] = Counter(
        (e.labels["syshax.deployment"], e.role) for e in node.running_engines()
    )
    return dict(counts)


def test_three_hosts_deploy_serve_lose_one_and_get_it_back(fleet: Fleet) -> None:
    timeline = Timeline()
    fleet.start_control_plane()
    # n3 reports no --address: the agent finds its own from the route to the control plane.
    nodes = [fleet.add_node("n1"), fleet.add_node("n2"), fleet.add_node("n3", report_address=False)]
    fleet.wait_online("n1", "n2", "n3")
    timeline.mark("nodes online")
    check_registered_over_the_network(fleet, nodes)

    deployments = deploy_one_per_node(fleet, nodes)
    timeline.mark("deployed")

    # A router on a machine of its own spreads concurrent requests over the three.
    router = fleet.router()
    endpoints = {n.name: f"http://{n.host.address}:{ENGINE_PORT}" for n in nodes}
    wait_until(lambda: router.backends() == set(endpoints.values()), 30, "router sees 3 engines")
    timeline.mark("router ready")
    spread = serve(router.url, nodes, 36)
    assert all(spread.values()), spread
    timeline.mark("spread")

    lose_n3(fleet, router, deployments, endpoints)
    timeline.mark("n3 lost")
    # The other two serve everything, with no client error.
    serve(router.url, nodes[:2], 24)
    wait_until(
        lambda: all(state(deployments[n]) == "running" for n in ("n1", "n2")),
        10,
        "n1's and n2's deployments running",
    )

    back_state = bring_back_n3(fleet, deployments["n3"], endpoints["n3"])
    timeline.mark("n3 back")
    wait_until(lambda: router.backends() == set(endpoints.values()), 10, "router sees n3 again")
    # Nothing duplicated: one engine per role per deployment on each machine, one command
    # per step and generation.
    for node in nodes:
        assert one_engine_per_role(node) == {(str(deployments[node.name].pk), "gpu"): 1}
    for deployment in deployments.values():
        steps = list(
            AgentCommand.objects.filter(deployment=deployment).values_list("generation", "step")
        )
        assert len(steps) == len(set(steps)), steps
    assert serve(router.url, nodes, 24)["n3"] > 0
    timeline.mark("done")
    print(f"\nspread over n1-n3: {spread}; n3's deployment when the node came back: {back_state}")
    print(f"timeline (s): {timeline}")


class Timeline:
    def __init__(self) -> None:
        self.began = time.monotonic()
        self.marks: dict[str, float] = {}

    def mark(self, what: str) -> None:
        self.marks[what] = time.monotonic() - self.began

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in self.marks.items())


def check_registered_over_the_network(fleet: Fleet, nodes: list[ClusterNode]) -> None:
    """Registered and heartbeating over the private network, each with its own address."""
    for node in nodes:
        row = fleet.node_row(node.name)
        assert row.address == node.host.address, (row.address, node.host.address)
        assert row.accelerators.get().simulated
        beats = Heartbeat.objects.filter(node_id=node.pk)
        wait_until(lambda: beats.count() >= 2, 10, f"a second heartbeat from {node.name}")  # noqa: B023


def deploy_one_per_node(fleet: Fleet, nodes: list[ClusterNode]) -> dict[str, Deployment]:
    """One deployment pinned to each node, deployed together; each engine runs on its node's
    machine and is published at the node's address."""
    profile = make_profile()
    deployments = {
        node.name: services.create_deployment(
            name=f"sim-{node.name}",
            profile=profile,
            node=fleet.node_row(node.name),
            acting_user=fleet.admin,
        )
        for node in nodes
    }
    for deployment in deployments.values():
        services.request_deploy(deployment, acting_user=fleet.admin)
    wait_until(
        lambda: all(state(d) in ("running", "failed") for d in deployments.values()),
        90,
        "three deployments",
    )
    for node in nodes:
        deployment = Deployment.objects.get(pk=deployments[node.name].pk)
        assert deployment.state == "running", deployment.state_reason
        assert deployment.gpu_endpoint == f"http://{node.host.address}:{ENGINE_PORT}"
        (engine,) = node.running_engines()
        assert engine.labels["syshax.deployment"] == str(deployment.pk)
        assert int(engine.extra["pid"]) in node.host.pids()  # inside the node's namespace
    return deployments


def serve(url: str, nodes: list[ClusterNode], requests: int) -> dict[str, int]:
    """Send ``requests`` completions, six at a time; all succeed and ``nodes``' engines
    served every one. Returns how many each served."""
    before = {n.name: served(n) for n in nodes}
    outcomes = burst(url, requests)
    assert outcomes == Counter(ok=requests), outcomes
    spread = {n.name: served(n) - before[n.name] for n in nodes}
    assert sum(spread.values()) == requests, spread
    return spread


def lose_n3(
    fleet: Fleet,
    router: ClusterRouter,
    deployments: dict[str, Deployment],
    endpoints: dict[str, str],
) -> None:
    """n3's machine is lost, with its agent and engine, while clients keep sending."""
    load = Load(router.url)
    time.sleep(0.5)
    killed_at = time.monotonic()
    killed_wall = timezone.now()
    fleet.kill_node("n3")
    lost: list[str] = []

    def n3_lost() -> bool:
        lost.extend(fleet.reap())
        return "n3" in lost

    wait_until(n3_lost, 30, "the reaper to mark n3 lost")
    offline_after = time.monotonic() - killed_at
    assert fleet.node_row("n3").status == "offline"
    assert state(deployments["n3"]) == "unknown"
    wait_until(
        lambda: router.backends() == {endpoints["n1"], endpoints["n2"]},
        10,
        "the router to drop n3's engine",
    )
    dropped_after = time.monotonic() - killed_at
    time.sleep(1.0)
    during = load.stop()
    # The other machines kept the network: no gap in their heartbeats around the loss beyond
    # what a busy 2-core machine causes. (A bridge whose MAC followed its ports silenced
    # them for longer than the grace period.)
    gaps = {n: heartbeat_gap(fleet.nodes[n], killed_wall) for n in ("n1", "n2")}
    assert max(gaps.values()) < 2 * fleet.interval * fleet.tolerance, gaps
    settled_at = killed_at + dropped_after
    late = Counter(o for sent, _, o in during if sent >= settled_at)
    window = Counter(o for sent, done, o in during if sent < settled_at and done >= killed_at)
    failures = [
        f"{o} at +{sent - killed_at:.2f} s after {done - sent:.2f} s"
        for sent, done, o in during
        if o != "ok"
    ]
    print(
        f"\nn3 lost: offline after {offline_after:.2f} s, dropped by the router after "
        f"{dropped_after:.2f} s; requests in between: {dict(window)}, after: {dict(late)}; "
        f"failures: {failures}; nodes reaped: {lost}; n1/n2 heartbeat gaps: {gaps}"
    )
    # In between too: a request on n3's engine as it dies moves to another replica of the
    # model before any output reached the client (docs/router.md, "Replicas").
    assert set(window) <= {"ok"}, window
    assert late and set(late) == {"ok"}, late


def bring_back_n3(fleet: Fleet, deployment: Deployment, endpoint: str) -> str:
    """n3 comes back: a new namespace with the same address and disk, the agent restarted.
    Returns the deployment's state once the control plane knows what the agent found."""
    n3 = fleet.restore_node("n3")
    fleet.wait_online("n3")
    assert fleet.node_row("n3").address == n3.host.address
    assert Node.objects.count() == 3  # nothing registered twice
    # Its engine died with the machine, and the restarted agent says so (the record in its
    # state dir has a dead PID).
    lost_generation = Deployment.objects.get(pk=deployment.pk).generation
    wait_until(
        lambda: ContainerInstance.objects.filter(
            deployment_id=deployment.pk, generation=lost_generation, status="exited"
        ).exists(),
        10,
        "n3's agent to report its dead engine",
    )
    back_state = state(deployment)
    if back_state == "unknown":
        # Nothing restarted it by itself, so the operator redeploys it.
        assert n3.running_engines() == []
        services.request_deploy(Deployment.objects.get(pk=deployment.pk), acting_user=fleet.admin)
    wait_until(lambda: state(deployment) in ("running", "failed"), 60, "n3 running again")
    redeployed = Deployment.objects.get(pk=deployment.pk)
    assert redeployed.state == "running", redeployed.state_reason
    assert redeployed.gpu_endpoint == endpoint
    return back_state
