"""Placement: which node a deployment runs on, and the cards and cores it holds there
(docs/lifecycles.md, "Placement").

The modules, from the bottom up:

- ``fit``: does a profile fit a node? Pure checks over loaded rows, and
  :class:`PlacementError`, the error every refusal here raises (it names the field).
- ``scheduler``: the choice of a node and its cards from the fleet's free resources; a pure
  function, no database.
- ``cores``: the CPU engine's cores on a node (the agents' planner in ``common.affinity``,
  less the cores other active deployments hold), and :func:`placement_plan`, the fit check
  and that plan together, as a deployment stores it.
- ``claims``: the fleet as the scheduler sees it, read from the database; the placement lock;
  the cards' claims.

Locking. A deploy (``services.request_deploy``, ``services.reschedule``) locks its own
deployment's row, then :func:`place_and_claim`, in that same transaction, takes one lock for
the whole fleet: on PostgreSQL a transaction-scoped advisory lock (``pg_advisory_xact_lock``
on ``PLACEMENT_LOCK_KEY``), held until the transaction commits or rolls back. No node, card or
claim row is locked. On SQLite, which lets one writer at a time, no lock is taken. Under the
lock the node is chosen on what every earlier placement committed, the deployment's old
claims are dropped and one :class:`AcceleratorClaim` per card is written. The claim's unique
card key is the last guard: a writer that bypassed the lock cannot take a card twice (its
deploy fails with a PlacementError asking to retry). Cores and ports are checked in the same
choice, from the other active deployments' plans.

Creating a placed deployment only chooses its node (:func:`choose`, no lock, nothing claimed);
its cards are claimed when it deploys. A deployment frees its cards when it stops or fails
(:func:`release`); deleting one whose engines may still run is refused
(``services.delete_deployment``), so a delete never frees them.
"""

from __future__ import annotations

from controlplane.deployments.placement.claims import (
    PLACEMENT_LOCK_KEY,
    choose,
    place_and_claim,
    release,
)
from controlplane.deployments.placement.cores import ACTIVE, placement_plan, plan_for
from controlplane.deployments.placement.fit import (
    MIN_ACCELERATOR_MEMORY_GB,
    PlacementError,
    check_placement,
)
from controlplane.deployments.placement.scheduler import Choice, Constraints, NoPlacement

__all__ = [
    "ACTIVE",
    "MIN_ACCELERATOR_MEMORY_GB",
    "PLACEMENT_LOCK_KEY",
    "Choice",
    "Constraints",
    "NoPlacement",
    "PlacementError",
    "check_placement",
    "choose",
    "place_and_claim",
    "placement_plan",
    "plan_for",
    "release",
]
