from django.db import models

from controlplane.core.lifecycle import Lifecycle


class NodeStatus(models.TextChoices):
    PENDING = "pending", "pending (never seen)"
    ONLINE = "online", "online"
    OFFLINE = "offline", "offline"
    DRAINING = "draining", "draining"


_N = NodeStatus
# docs/lifecycles.md#node shows this table; test_lifecycles.py checks they agree. Heartbeats
# and the reaper move a node with compare-and-set updates; people only drain and undrain.
NODE_LIFECYCLE = Lifecycle(
    "status",
    {
        _N.PENDING: {_N.ONLINE, _N.DRAINING},
        _N.ONLINE: {_N.OFFLINE, _N.DRAINING},
        _N.OFFLINE: {_N.ONLINE, _N.DRAINING},
        # Undrained: online through the API, offline (online at its next heartbeat) in the admin.
        _N.DRAINING: {_N.ONLINE, _N.OFFLINE},
    },
)
# The moves a person makes (admin, API): drain from anywhere, undrain a drained node.
OPERATOR_NODE_MOVES: dict[str, frozenset[str]] = {
    _N.DRAINING: NODE_LIFECYCLE.sources(_N.DRAINING),
    _N.ONLINE: frozenset({_N.DRAINING}),
}


class AcceleratorKind(models.TextChoices):
    GPU = "gpu", "GPU"
    NPU = "npu", "NPU"


class InventoryAuditAction(models.TextChoices):
    """The audit rows' actions on nodes and accelerators (``AuditEntry.action``)."""

    INVENTORY_UPDATED = "inventory.updated"
    NODE_ONLINE = "node.online"
    NODE_OFFLINE = "node.offline"
    NODE_DELETED = "node.deleted"
    ACCELERATOR_DELETED = "accelerator.deleted"
