"""Where a deployment runs: a pure function from the fleet's free resources to a choice.

No database here: :mod:`controlplane.deployments.placement.claims` builds the :class:`NodeView`
of each node from its rows (cards already claimed, cores held by other deployments, ports in
use), calls :func:`choose`, and claims the choice (the package docstring says under which lock).

The rules (docs/lifecycles.md, "Placement"):

1. A node must be online (not offline, pending or draining) and carry every label of the
   deployment's node selector.
2. It must have ``accelerators`` free cards of the wanted kind, each with at least the wanted
   memory. A card is free when no active deployment claims it.
3. Its engines' ports must be free on it (engines use host networking).
4. The CPU engine needs ``cpu_cores`` free physical cores, on one NUMA node when asked.
5. Among the nodes left: the fewest engines of the same model first (replicas spread), then
   the tightest fit (fewest free matching cards left over, so whole nodes stay free for big
   deployments), then the name, so the choice is deterministic.

A refusal names the first rule no node passed, with the closest node's numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

GIB = 1024**3
PLACEABLE_STATUSES = ("online",)


@dataclass(frozen=True)
class CardView:
    uuid: str
    index: int
    kind: str
    memory_bytes: int
    free: bool


@dataclass(frozen=True)
class NodeView:
    name: str
    status: str
    labels: Mapping[str, str] = field(default_factory=dict)
    cards: tuple[CardView, ...] = ()
    free_cores_per_numa: Mapping[int, int] = field(default_factory=dict)
    ports_in_use: frozenset[int] = frozenset()
    same_model_engines: int = 0  # deployments of the same model already on the node


@dataclass(frozen=True)
class Constraints:
    accelerators: int = 1
    accelerator_kind: str = ""  # "" any
    min_device_memory_bytes: int = 0
    cpu_engine: bool = True
    cpu_cores: int | None = None  # None: at least one free core
    cpu_numa_local: bool = False
    ports: tuple[int, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Choice:
    node: str
    cards: tuple[str, ...]  # UUIDs, by index
    numa_node: int | None  # the NUMA node of a NUMA-local CPU engine
    reason: str


class NoPlacement(Exception):
    """No node satisfies the constraints. ``field`` names the constraint that failed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def matching_cards(node: NodeView, wanted: Constraints) -> list[CardView]:
    return sorted(
        (
            card
            for card in node.cards
            if card.free
            and (not wanted.accelerator_kind or card.kind == wanted.accelerator_kind)
            and card.memory_bytes >= wanted.min_device_memory_bytes
        ),
        key=lambda card: card.index,
    )


def _cores_fit(node: NodeView, wanted: Constraints) -> tuple[bool, int | None, int]:
    """(fits, the NUMA node to use, the best count found) for the CPU engine's cores."""
    need = wanted.cpu_cores or 1
    if wanted.cpu_numa_local:
        best = max(node.free_cores_per_numa.items(), key=lambda kv: (kv[1], -kv[0]), default=None)
        if best is None:
            return False, None, 0
        return best[1] >= need, best[0], best[1]
    total = sum(node.free_cores_per_numa.values())
    return total >= need, None, total


def _card_words(wanted: Constraints) -> str:
    kind = wanted.accelerator_kind.upper() or "accelerator"
    memory = (
        f" with at least {wanted.min_device_memory_bytes / GIB:g} GiB"
        if wanted.min_device_memory_bytes
        else ""
    )
    return f"{wanted.accelerators} free {kind} card(s){memory}"


def _card_constraint(nodes: Sequence[NodeView], wanted: Constraints) -> str:
    """Which card constraint to name: the narrowest one whose removal would let a node fit."""

    def enough(**relaxed: object) -> bool:
        loose = replace(wanted, **relaxed)  # type: ignore[arg-type]
        return any(len(matching_cards(n, loose)) >= wanted.accelerators for n in nodes)

    if wanted.min_device_memory_bytes and enough(min_device_memory_bytes=0):
        return "min_device_memory_gb"
    if wanted.accelerator_kind and enough(accelerator_kind="", min_device_memory_bytes=0):
        return "accelerator_kind"
    return "tensor_parallel_size"


def choose(nodes: Sequence[NodeView], wanted: Constraints) -> Choice:
    """The node (and cards) for ``wanted``; raises :class:`NoPlacement` naming the rule."""
    if not nodes:
        raise NoPlacement("node", "the fleet has no nodes")
    online = [n for n in nodes if n.status in PLACEABLE_STATUSES]
    if not online:
        raise NoPlacement("node", f"none of the {len(nodes)} node(s) is online")
    selector = dict(wanted.node_selector)
    labelled = [n for n in online if all(n.labels.get(k) == v for k, v in selector.items())]
    if not labelled:
        wanted_labels = ", ".join(f"{k}={v}" for k, v in sorted(selector.items()))
        raise NoPlacement(
            "node_selector", f"no online node carries {wanted_labels} ({len(online)} online)"
        )
    with_cards = [(n, matching_cards(n, wanted)) for n in labelled]
    carded = [(n, cards) for n, cards in with_cards if len(cards) >= wanted.accelerators]
    if not carded:
        closest = max(with_cards, key=lambda nc: (len(nc[1]), nc[0].name))
        field_name = _card_constraint(labelled, wanted)
        raise NoPlacement(
            field_name,
            f"no node has {_card_words(wanted)}; the closest, {closest[0].name!r}, has "
            f"{len(closest[1])} ({len(labelled)} node(s) checked)",
        )
    ported = [(n, c) for n, c in carded if not n.ports_in_use.intersection(wanted.ports)]
    if not ported:
        busy = sorted(set(wanted.ports) & carded[0][0].ports_in_use)
        raise NoPlacement(
            "ports",
            f"port(s) {', '.join(map(str, busy))} are in use on every node with "
            f"{_card_words(wanted)} (engines use host networking)",
        )
    fitting: list[tuple[NodeView, list[CardView], int | None]] = []
    best_cores: tuple[int, str] = (-1, "")
    for node, cards in ported:
        if not wanted.cpu_engine:
            fitting.append((node, cards, None))
            continue
        fits, numa, count = _cores_fit(node, wanted)
        if fits:
            fitting.append((node, cards, numa))
        best_cores = max(best_cores, (count, node.name))
    if not fitting:
        where = " on one NUMA node" if wanted.cpu_numa_local else ""
        raise NoPlacement(
            "cpu_cores",
            f"the CPU engine needs {wanted.cpu_cores or 1} free physical core(s){where}; the "
            f"closest node, {best_cores[1]!r}, has {best_cores[0]}",
        )
    node, cards, numa = min(
        fitting,
        key=lambda f: (f[0].same_model_engines, len(f[1]) - wanted.accelerators, f[0].name),
    )
    taken = tuple(card.uuid for card in cards[: wanted.accelerators])
    reason = (
        f"{node.name}: {len(cards)} matching free card(s), "
        f"{sum(node.free_cores_per_numa.values())} free core(s), "
        f"{node.same_model_engines} engine(s) of the model already there; "
        f"{len(fitting)} of {len(nodes)} node(s) fit"
    )
    return Choice(node=node.name, cards=taken, numa_node=numa, reason=reason)
