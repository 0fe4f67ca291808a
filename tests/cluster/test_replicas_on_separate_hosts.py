"""Placement and rescheduling across separate hosts (network namespaces, tests/support/netns.py).

Four nodes, one deployment of three replicas that the control plane places: one replica per
node, the router spreading requests over the three. The machine of one replica is lost: the
reaper marks it offline and the scheduler places that replica again on the spare node, where
it runs and serves. The lost machine comes back: nothing runs twice anywhere.
"""

from __future__ import annotations

from collections import Counter

import pytest

from controlplane.deployments import services
from controlplane.deployments.models import Deployment
from tests.cluster.fleet import Fleet
from tests.cluster.test_separate_hosts import ENGINE_PORT, make_profile, serve, state
from tests.support.controlplane import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.django_db(transaction=True)]


def replicas_of(first: Deployment) -> list[Deployment]:
    return [
        Deployment.objects.select_related("node").get(pk=first.pk),
        *Deployment.objects.select_related("node")
        .filter(replica_of=first)
        .order_by("replica_index"),
    ]


def engines_everywhere(fleet: Fleet) -> Counter[tuple[str, str]]:
    """(deployment id, generation) of every engine running on any machine still up."""
    out: Counter[tuple[str, str]] = Counter()
    for node in fleet.nodes.values():
        if node.agent is None:
            continue
        for engine in node.running_engines():
            out[(engine.labels["syshax.deployment"], engine.labels["syshax.generation"])] += 1
    return out


def test_replicas_are_placed_one_per_host_and_a_lost_one_moves(fleet: Fleet) -> None:
    fleet.start_control_plane()
    for name in ("n1", "n2", "n3", "n4"):
        fleet.add_node(name, labels={"zone": "z1"})
    fleet.wait_online("n1", "n2", "n3", "n4")

    first = services.create_deployment(
        name="wide",
        profile=make_profile(),
        node=None,  # the control plane places it
        acting_user=fleet.admin,
        replicas=3,
        node_selector={"zone": "z1"},
        start=True,
    )
    wait_until(
        lambda: all(state(r) in ("running", "failed") for r in replicas_of(first)),
        90,
        "three replicas",
    )
    replicas = replicas_of(first)
    assert [r.state for r in replicas] == ["running"] * 3, [r.state_reason for r in replicas]
    placed = {r.name: r.node.name for r in replicas}
    assert len(set(placed.values())) == 3, placed  # one replica per node
    (spare,) = {"n1", "n2", "n3", "n4"} - set(placed.values())

    router = fleet.router()
    wanted = {f"http://{fleet.nodes[n].host.address}:{ENGINE_PORT}" for n in placed.values()}
    wait_until(lambda: router.backends() == wanted, 30, "router sees the three replicas")
    spread = serve(router.url, [fleet.nodes[n] for n in placed.values()], 30)
    assert all(spread.values()), spread

    # The machine of replica 2 is lost; the scheduler places it again on the spare node.
    moved = replicas[1]
    lost = moved.node.name
    fleet.kill_node(lost)
    wait_until(lambda: lost in fleet.reap(), 30, f"the reaper to mark {lost} lost")
    wait_until(
        lambda: (
            (d := Deployment.objects.select_related("node").get(pk=moved.pk)).node.name == spare
            and d.state == "running"
        ),
        90,
        f"{moved.name} running again on {spare}",
    )
    again = Deployment.objects.get(pk=moved.pk)
    assert again.generation == moved.generation + 1
    assert f"node {lost} lost; placed again on node {spare}" in " ".join(
        again.events.values_list("message", flat=True)
    )
    now_on = [n for n in placed.values() if n != lost] + [spare]
    wanted = {f"http://{fleet.nodes[n].host.address}:{ENGINE_PORT}" for n in now_on}
    wait_until(lambda: router.backends() == wanted, 30, "router sees the moved replica")
    assert serve(router.url, [fleet.nodes[n] for n in now_on], 24)[spare] > 0

    # The lost machine returns: it runs nothing of the moved replica, and nothing runs twice.
    fleet.restore_node(lost)
    fleet.wait_online(lost)
    wait_until(
        lambda: not fleet.nodes[lost].running_engines(), 30, f"{lost} runs no engine of ours"
    )
    counts = engines_everywhere(fleet)
    assert sorted(counts.values()) == [1, 1, 1], counts
    assert {d for d, _ in counts} == {str(r.pk) for r in replicas}
