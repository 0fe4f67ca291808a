"""Placement: the scheduler's rules, claims that never double-book a card, and rescheduling
when a node is lost (docs/lifecycles.md, "Placement")."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from controlplane.deployments import services
from controlplane.deployments.models import AcceleratorClaim, AgentCommand, Deployment
from controlplane.deployments.placement import PlacementError
from controlplane.deployments.placement.scheduler import (
    GIB,
    CardView,
    Constraints,
    NodeView,
    NoPlacement,
    choose,
)
from controlplane.inventory.services import mark_lost_nodes
from testbed.factories import build_node, build_profile


def view(name: str, cards: int = 1, *, gb: int = 80, kind: str = "gpu", **fields: Any) -> NodeView:
    return NodeView(
        name=name,
        status=fields.pop("status", "online"),
        cards=tuple(
            CardView(f"{name}-{i}", i, kind, gb * GIB, free=i >= fields.get("taken", 0))
            for i in range(cards)
        ),
        free_cores_per_numa=fields.pop("cores", {0: 4, 1: 4}),
        **{k: v for k, v in fields.items() if k != "taken"},
    )


# ---------------------------------------------------------------- the pure rules


def test_the_tightest_fit_wins_and_replicas_spread() -> None:
    nodes = [view("big", 8), view("small", 2), view("mid", 4)]
    choice = choose(nodes, Constraints(accelerators=2))
    assert (choice.node, choice.cards) == ("small", ("small-0", "small-1"))
    crowded = [view("a", 2, same_model_engines=1), view("b", 4)]
    assert choose(crowded, Constraints(accelerators=1)).node == "b"  # spread before fit


def test_taken_cards_are_never_chosen() -> None:
    choice = choose([view("n", 2, taken=1)], Constraints(accelerators=1))
    assert choice.cards == ("n-1",)


@pytest.mark.parametrize(
    ("nodes", "wanted", "field", "words"),
    [
        ([], Constraints(), "node", "no nodes"),
        ([view("a", status="offline")], Constraints(), "node", "none of the 1 node(s) is online"),
        (
            [view("a", labels={"rack": "r2"})],
            Constraints(node_selector={"rack": "r1"}),
            "node_selector",
            "no online node carries rack=r1",
        ),
        ([view("a", 1)], Constraints(accelerators=2), "tensor_parallel_size", "has 1"),
        (
            [view("a", 2, gb=40)],
            Constraints(min_device_memory_bytes=64 * GIB),
            "min_device_memory_gb",
            "at least 64 GiB",
        ),
        ([view("a", 2)], Constraints(accelerator_kind="npu"), "accelerator_kind", "NPU"),
        (
            [view("a", 2, ports_in_use=frozenset({7001}))],
            Constraints(ports=(7001, 7002)),
            "ports",
            "7001",
        ),
        (
            [view("a", 2, cores={0: 2, 1: 2})],
            Constraints(cpu_cores=3, cpu_numa_local=True),
            "cpu_cores",
            "3 free physical core(s) on one NUMA node; the closest node, 'a', has 2",
        ),
    ],
)
def test_every_refusal_names_its_constraint(nodes, wanted, field, words) -> None:
    with pytest.raises(NoPlacement) as refused:
        choose(nodes, wanted)
    assert refused.value.field == field
    assert words in refused.value.message


def test_a_numa_local_cpu_engine_gets_the_node_with_room_on_one_numa_node() -> None:
    nodes = [view("spread", cores={0: 2, 1: 2}), view("local", cores={0: 1, 1: 4})]
    choice = choose(nodes, Constraints(cpu_cores=3, cpu_numa_local=True))
    assert (choice.node, choice.numa_node) == ("local", 1)
    assert choose(nodes[:1], Constraints(cpu_cores=3)).node == "spread"  # evenly: 2 + 2


# ---------------------------------------------------------------- against the database


@pytest.fixture
def fleet(db) -> list:
    return [
        build_node(f"rack{rack}-{i}", accelerators=2, status="online", labels={"rack": f"r{rack}"})
        for rack in (1, 2)
        for i in (1, 2)
    ]


def create(name: str, profile=None, **placement: Any) -> Deployment:
    return services.create_deployment(
        name=name,
        profile=profile or build_profile(enable_cpu_engine=False),
        node=None,
        acting_user="test",
        **placement,
    )


def test_a_deployment_without_a_node_is_placed_by_the_scheduler(fleet, admin_client) -> None:
    profile = build_profile(tensor_parallel_size=2, enable_cpu_engine=False)
    answer = admin_client.post(
        "/api/v1/deployments/",
        {"name": "auto", "profile": profile.pk, "node_selector": {"rack": "r2"}},
        format="json",
    )
    assert answer.status_code == 201, answer.content
    body = answer.json()
    assert body["pinned"] is False
    assert Deployment.objects.get(pk=body["id"]).node.labels == {"rack": "r2"}
    assert body["accelerators"] == []  # cards are claimed when it deploys

    deployment = services.request_deploy(Deployment.objects.get(pk=body["id"]), acting_user="t")
    claimed = sorted(
        AcceleratorClaim.objects.filter(deployment=deployment).values_list(
            "accelerator__uuid", flat=True
        )
    )
    assert claimed == [f"GPU-{deployment.node.name}-0", f"GPU-{deployment.node.name}-1"]
    spec = services_spec(deployment)
    assert [a["uuid"] for a in spec["accelerators"]] == claimed

    refused = admin_client.post(
        "/api/v1/deployments/",
        {"name": "nowhere", "profile": profile.pk, "node_selector": {"rack": "r9"}},
        format="json",
    )
    assert refused.status_code == 400
    assert "no online node carries rack=r9" in refused.json()["error"]["fields"]["node_selector"][0]


def services_spec(deployment: Deployment) -> dict:
    from controlplane.deployments.specs import engine_spec

    return engine_spec(deployment, "gpu")


def test_deployments_on_one_node_hold_different_cards_and_a_third_is_refused(db) -> None:
    node = build_node("two-cards", accelerators=2, status="online")
    claimed = []
    for port in (7101, 7201):
        profile = build_profile(enable_cpu_engine=False, gpu_port=port, cpu_port=port + 1)
        deployment = services.create_deployment(
            name=f"d{port}", profile=profile, node=node, acting_user="test", start=True
        )
        claimed.append(deployment.accelerator_claims.get().accelerator.uuid)
    assert sorted(claimed) == ["GPU-two-cards-0", "GPU-two-cards-1"]
    third = services.create_deployment(
        name="d3",
        profile=build_profile(enable_cpu_engine=False, gpu_port=7301, cpu_port=7302),
        node=node,
        acting_user="test",
    )
    with pytest.raises(PlacementError, match=r"no node has 1 free accelerator card\(s\)"):
        services.request_deploy(third, acting_user="test")


def test_a_stopped_deployment_frees_its_cards(db) -> None:
    node = build_node("one-card", accelerators=1, status="online")
    deployment = create("first", node_selector={})
    services.request_deploy(deployment, acting_user="t")
    assert AcceleratorClaim.objects.filter(accelerator__node=node).count() == 1
    deployment.refresh_from_db()
    services.set_state(deployment, "stopping")  # the table's way down: deploying, stopping
    assert AcceleratorClaim.objects.count() == 1
    services.set_state(deployment, "stopped")
    deployment.save()
    assert not AcceleratorClaim.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_deploys_never_double_book_a_card() -> None:
    nodes = [build_node(f"c{i}", accelerators=2, status="online") for i in range(5)]
    deployments = [
        create(
            f"race-{i}",
            build_profile(enable_cpu_engine=False, gpu_port=8000 + 2 * i, cpu_port=8001 + 2 * i),
        )
        for i in range(16)
    ]
    connections.close_all()
    errors: list[str] = []
    barrier = threading.Barrier(8)

    def deploy(chunk: list[Deployment]) -> None:
        barrier.wait()
        for deployment in chunk:
            try:
                services.request_deploy(deployment, acting_user="race")
            except PlacementError as exc:
                errors.append(f"{exc.field}: {exc.message}")
        connections.close_all()

    threads = [threading.Thread(target=deploy, args=(deployments[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    claims = list(AcceleratorClaim.objects.values_list("accelerator_id", "deployment_id"))
    assert len(claims) == 10 == len({card for card, _ in claims})  # 5 nodes x 2 cards, once each
    assert len(errors) == 6, errors
    assert all(e.startswith("tensor_parallel_size: no node has 1 free") for e in errors), errors
    assert len(nodes) == 5


def test_a_lost_node_s_placed_deployment_is_placed_again_elsewhere(
    fleet, settings, django_capture_on_commit_callbacks
) -> None:
    settings.CELERY_TASK_ALWAYS_EAGER = True
    deployment = create("moving", node_selector={"rack": "r1"})
    services.request_deploy(deployment, acting_user="t")
    deployment.refresh_from_db()
    services.set_state(deployment, "running")
    deployment.save()
    lost = deployment.node
    pinned = services.create_deployment(
        name="stays",
        profile=build_profile(enable_cpu_engine=False, gpu_port=7401, cpu_port=7402),
        node=lost,
        acting_user="t",
        start=True,
    )
    Deployment.objects.filter(pk=pinned.pk).update(state="running")
    type(lost).objects.filter(pk=lost.pk).update(
        last_heartbeat_at=timezone.now() - timezone.timedelta(hours=1)
    )
    with django_capture_on_commit_callbacks(execute=True):
        mark_lost_nodes()  # queues the reschedule (eager here)

    deployment.refresh_from_db()
    assert deployment.node.name != lost.name and deployment.node.labels == {"rack": "r1"}
    assert deployment.state == "deploying" and deployment.generation == 2
    assert f"node {lost.name} lost; placed again on node {deployment.node.name}" in (
        deployment.state_reason
    )
    assert {c.accelerator.node_id for c in deployment.accelerator_claims.all()} == {
        deployment.node_id
    }
    assert Deployment.objects.get(pk=pinned.pk).state == "unknown"  # pinned: it waits

    # The lost node returns, still running the moved deployment's old engines: stopped there
    # once, however often the agent reports them.
    report = [
        {
            "deployment_id": deployment.pk,
            "generation": 1,
            "role": "gpu",
            "engine_id": "e1",
            "status": "running",
        }
    ]
    services.sync_containers(lost, report)
    services.sync_containers(lost, report)
    (stop,) = AgentCommand.objects.filter(node=lost, deployment=deployment)
    assert stop.action == "stop" and stop.spec["keep_generation"] is None


def test_with_no_room_the_deployment_says_so_and_moves_when_room_appears(
    db, settings, django_capture_on_commit_callbacks
) -> None:
    settings.CELERY_TASK_ALWAYS_EAGER = True
    only = build_node("only", accelerators=1, status="online")
    deployment = create("stuck")
    services.request_deploy(deployment, acting_user="t")
    Deployment.objects.filter(pk=deployment.pk).update(state="running")
    type(only).objects.filter(pk=only.pk).update(
        last_heartbeat_at=timezone.now() - timezone.timedelta(hours=1)
    )
    with django_capture_on_commit_callbacks(execute=True):
        mark_lost_nodes()
    deployment.refresh_from_db()
    assert deployment.state == "unknown" and deployment.node == only
    assert deployment.state_reason.startswith("node only lost; no other node has room: node:")
    assert services.stranded_deployments() == [deployment.pk]

    build_node("spare", accelerators=1, status="online")
    from controlplane.deployments.tasks import reschedule_stranded

    assert reschedule_stranded() == 1
    deployment.refresh_from_db()
    assert (deployment.node.name, deployment.state) == ("spare", "deploying")


# ---------------------------------------------------------------- replicas


def test_replicas_spread_over_nodes_and_follow_their_first(fleet, admin_client) -> None:
    profile = build_profile(enable_cpu_engine=False)
    answer = admin_client.post(
        "/api/v1/deployments/",
        {"name": "wide", "profile": profile.pk, "replicas": 3, "start": True},
        format="json",
    )
    assert answer.status_code == 201, answer.content
    first = Deployment.objects.get(name="wide")
    replicas = [first, *first.replica_set.order_by("replica_index")]
    assert [r.name for r in replicas] == ["wide", "wide-r2", "wide-r3"]
    assert all(r.state == "deploying" and r.generation == 1 for r in replicas)
    assert len({r.node_id for r in replicas}) == 3  # one per node
    assert all(r.accelerator_claims.count() == 1 for r in replicas)

    edit = admin_client.patch(
        f"/api/v1/deployments/{replicas[1].pk}/", {"cpu_cores": 2}, format="json"
    )
    assert edit.status_code == 400 and "first replica" in edit.content.decode()

    services.request_stop(first, acting_user="t")
    assert set(Deployment.objects.values_list("desired_state", flat=True)) == {"stopped"}

    # Down to one: the extra replicas retire (removed once stopped).
    Deployment.objects.update(state="stopped")
    shrunk = admin_client.patch(f"/api/v1/deployments/{first.pk}/", {"replicas": 1}, format="json")
    assert shrunk.status_code == 200, shrunk.content
    assert list(Deployment.objects.values_list("name", flat=True)) == ["wide"]


def test_all_replicas_are_placed_or_none(db) -> None:
    build_node("r-only", accelerators=1, status="online")
    deployment = create("two", replicas=2)
    with pytest.raises(PlacementError, match="replica 2: no node has 1 free"):
        services.request_deploy(deployment, acting_user="t")
    deployment.refresh_from_db()
    assert deployment.state == "pending" and not AcceleratorClaim.objects.exists()
