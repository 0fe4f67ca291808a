from django.db import models


class NodeStatus(models.TextChoices):
    PENDING = "pending", "pending (never seen)"
    ONLINE = "online", "online"
    OFFLINE = "offline", "offline"
    DRAINING = "draining", "draining"


class AcceleratorKind(models.TextChoices):
    GPU = "gpu", "GPU"
    NPU = "npu", "NPU"
