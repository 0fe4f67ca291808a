"""The deployments app's answers to what the inventory announces (inventory/signals.py),
connected in apps.py."""

from __future__ import annotations

from typing import Any

from controlplane.core import dispatch
from controlplane.deployments.choices import RECONCILE_NODE_TASK
from controlplane.deployments.services import mark_node_deployments_unknown
from controlplane.inventory.models import Node


def on_node_lost(sender: Any, node: Node, **kwargs: Any) -> None:
    # In the reaper's transaction: the node's deployments go unknown with it, or not at all.
    mark_node_deployments_unknown(node)


def on_node_returned(sender: Any, node_id: int, **kwargs: Any) -> None:
    # After the commit: re-check what the node's agent says is still running, in a task.
    dispatch.task(RECONCILE_NODE_TASK).delay(node_id)
