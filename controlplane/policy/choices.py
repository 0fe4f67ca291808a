from django.db import models


class PolicyMode(models.TextChoices):
    AUTO = "auto", "auto (hetero: decide per request)"
    GPU_ONLY = "gpu-only", "GPU only"
    CPU_ONLY = "cpu-only", "CPU only"
    FORCED_PD = "forced-pd", "forced PD (GPU prefill, CPU decode)"


class DeciderAlgorithm(models.TextChoices):
    CAPACITY = "capacity", "capacity-aware"
    SYSHAX_THRESHOLD = "syshax-threshold", "sysHAX threshold decider"
