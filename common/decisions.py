"""What a routing decision can be: the policy's modes, the routes, the decision stages and
the reason codes, listed once.

The router decides with them (``router.decide``), its metrics label with them, the control
plane's dashboard and machine API read them back, and docs/router.md ("Decision codes")
lists every code (a test holds the list and this module equal). Each is a ``StrEnum``: its
members are the very strings that go over the wire (``X-Syshax-Route``,
``X-Syshax-Reason``, metric labels, the stats a router posts), so a member compares equal to
the string a peer sends and ``str()`` of it is that string.
"""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """A policy's ``mode`` (and a benchmark's ``X-Syshax-Mode``): the route pinned, or not."""

    AUTO = "auto"  # the decider's algorithm chooses
    GPU_ONLY = "gpu-only"
    CPU_ONLY = "cpu-only"
    FORCED_PD = "forced-pd"  # GPU prefill, CPU decode to the end


class ReplicaChoice(StrEnum):
    """A policy's ``replica_choice``: how a request's replica is picked among several."""

    LEAST_LOADED = "least-loaded"  # the least pressured replica
    PREFIX = "prefix"  # the one sent the longest prefix of the prompt, within a load slack


class Route(StrEnum):
    """Where a request is served, in the order reports show them."""

    GPU_ONLY = "gpu-only"
    PD = "pd"
    CPU_ONLY = "cpu-only"
    REJECTED = "rejected"


class Stage(StrEnum):
    """When a decision is taken (the decisions metric's ``stage``)."""

    NEW = "new"  # a request arrives, or a failover's candidate replica
    CHUNK = "chunk"  # a CPU decode chunk ended


class Code(StrEnum):
    """Why a decision went the way it did: a short stable label (the reason text has numbers).

    Grouped by what gives them; docs/router.md ("Decision codes") says what each means.
    """

    # The replica choice.
    LEAST_LOADED = "least-loaded"
    PREFIX_HIT = "prefix-hit"
    # A pinned mode, and the engines being there at all.
    MODE = "mode"
    OFFLOAD_OFF = "offload-off"
    GPU_DOWN = "gpu-down"
    CPU_DOWN = "cpu-down"
    # The GPU: room, or what saturates it.
    GPU_ROOM = "gpu-room"
    GPU_HOT = "gpu-hot"
    GPU_MAX_SEQS = "gpu-max-seqs"
    GPU_KV_FULL = "gpu-kv-full"
    GPU_QUEUE = "gpu-queue"
    GPU_KNEE = "gpu-knee"
    GPU_KV_BLOCKED = "gpu-kv-blocked"
    # The CPU: what keeps a decode off it.
    CPU_WOULD_MISS = "cpu-would-miss"
    CPU_STALE = "cpu-stale"
    CPU_UNMEASURED = "cpu-unmeasured"
    CPU_PROBING = "cpu-probing"
    CPU_KNEE = "cpu-knee"
    CPU_FULL = "cpu-full"
    CPU_SLOW = "cpu-slow"
    HOST_MEMORY = "host-memory"
    BOTH_BUSY = "both-busy"
    QUEUE_FULL = "queue-full"
    # An SLO class that decodes on the CPU first.
    CLASS_CPU_ONLY = "class-cpu-only"
    CLASS_CPU_FIRST = "class-cpu-first"
    CLASS_GPU_SPARE = "class-gpu-spare"
    CLASS_WAIT = "class-wait"
    # After a CPU chunk.
    STAY = "stay"
    BACK = "back"
    BACK_CPU_SLOW = "back-cpu-slow"
    # What the request itself rules out.
    N_ABOVE_1 = "n-above-1"
    NO_CPU = "no-cpu"
    NOT_SPLICEABLE = "not-spliceable"
    # Flow control turning a waiting request away (``queue-full`` above too).
    EVICTED = "evicted"
    FAIR_SHARE = "fair-share"
    TIMEOUT = "timeout"


# The codes of a CPU's refusal that reach no decision: the decider answers ``both-busy`` (or
# waits for the measurement) instead.
INTERNAL_CODES = frozenset({Code.CPU_PROBING, Code.CPU_KNEE})
# Why flow control turns a waiting request away (the sheds metric's ``reason``).
SHED_CODES = (Code.QUEUE_FULL, Code.EVICTED, Code.FAIR_SHARE, Code.TIMEOUT)
