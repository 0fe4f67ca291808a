"""Hardware and model presets of the engine simulator.

Every number that comes from a datasheet says so in ``source``; docs/simulator.md repeats the
table with links. The two ``*_efficiency`` factors are not datasheet numbers: they are the
calibrated fraction of peak that a real vLLM engine reaches on that device (see the
calibration section of docs/simulator.md and ``scripts/bench/sim_calibrate.py``). Nor are the KV
handoff rates: they are a link's measured copy rate times the fraction of it our KV
connector reaches (:class:`ConnectorSpeed`, ``scripts/bench/kv_connector_timing.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GIB = 1024**3
GB = 1e9

DeviceKind = Literal["gpu", "npu", "cpu"]


@dataclass(frozen=True)
class DevicePreset:
    name: str
    kind: DeviceKind
    description: str
    memory_bytes: int  # accelerator memory, or host RAM for a CPU
    mem_bandwidth: float  # peak bytes/s
    peak_flops: float  # peak dense FLOP/s of the matmul path the engine uses
    bw_efficiency: float  # calibrated fraction of mem_bandwidth reached by decode
    flops_efficiency: float  # calibrated fraction of peak_flops reached by prefill
    step_overhead_s: float  # fixed per-step cost: scheduling, kernel launch, sampling
    kv_export_bandwidth: float  # bytes/s our connector copies KV out into shared memory
    kv_import_bandwidth: float  # bytes/s our connector copies KV from shared memory in
    # Of an export's copy time, the share the producer's step waits for (the rest overlaps
    # the forward); an import always holds the consumer's step (docs/simulator.md).
    kv_export_stall: float
    swap_bandwidth: float  # bytes/s for KV swap out/in (preemption mode swap)
    cores: int
    numa_nodes: int
    source: str

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hf_id: str
    quantization: str
    params: float  # parameter count
    bytes_per_param: float  # weight storage incl. quantisation scales
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: int  # the KV cache stays fp16/bf16 even for q4_0 weights
    max_position: int
    vocab_size: int  # token ids a prompt may use (config.json's vocab_size)
    source: str

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head.
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes


PCIE4_X16 = 25 * GB  # effective one-direction PCIe Gen4 x16 copy rate (32 GB/s raw)
PCIE5_X16 = 50 * GB


@dataclass(frozen=True)
class ConnectorSpeed:
    """How fast our KV connector moves KV on one kind of producer and consumer, as fractions
    of the link's own copy of the same bytes measured beside it, and how much of a save the
    producer's step waits for. ``scripts/bench/kv_connector_timing.py`` measures all three."""

    save_fraction: float
    load_fraction: float
    save_stall: float
    source: str


# The links' reference rates, measured: a device-to-pinned-host copy on an NVIDIA H200
# (PCIe Gen5 x16, torch 2.11, CUDA 13: 53-55 GB/s, issue 26's table); a PCIe Gen4 x16 card
# gets half of it (the datasheets' link rates, 32 against 64 GB/s a direction). A memcpy
# between two buffers of one NUMA node of a server CPU: 20 GB/s (this project's 2-core VM
# measures 22 GB/s with two threads).
H200_PINNED_D2H = 55 * GB
GEN4_PINNED_D2H = H200_PINNED_D2H / 2
GEN5_PINNED_D2H = H200_PINNED_D2H
CPU_MEMCPY = 20 * GB

# A CPU producer and consumer (both engines on the CPU): scripts/bench/kv_connector_timing.py on
# this project's 2-core VM, 2,048 tokens of an 8B geometry (268 MB), the median over three
# runs of each run's median of five (docs/kv-connector.md, "Figures"). The save is the one
# copy there is, done in the step: the step waits for all of it. The load writes from the
# mapping into the CPU backend's blocks, in the step that follows the segment's arrival.
CPU_CONNECTOR = ConnectorSpeed(
    save_fraction=0.72,
    load_fraction=0.58,
    save_stall=1.0,
    source="kv_connector_timing.py, CPU, 2,048 tokens of the 8B geometry: save 72 %, load "
    "58 % of a memcpy into a pre-faulted mapping",
)
# A CUDA producer: not yet measured with this connector (no card in the session that wrote
# it). Issue 26 measured its design on an H200 (per-layer gather, a side-stream copy into a
# cudaHostRegister'ed shm mapping, one completion event): the copies ran at the pinned rate
# beside the forward and added 0.7, -1.0, 4 and 7 ms to forwards whose copies alone took 1.3,
# 4.9, 19.6 and 38.8 ms (512 to 16,384 tokens): a median of 19 % of the copy's time.
# Replace with `kv_connector_timing.py --json` on a card.
CUDA_CONNECTOR = ConnectorSpeed(
    save_fraction=1.0,
    load_fraction=1.0,
    save_stall=0.19,
    source="issue 26's H200 measurement of the design (not yet of this connector): copies at "
    "the pinned rate, 19 % of their time added to the forward",
)


def handoff(speed: ConnectorSpeed, link: float) -> dict[str, float]:
    """A device's export and import rates and stall: its link's measured copy rate times the
    connector's speed there."""
    return {
        "kv_export_bandwidth": link * speed.save_fraction,
        "kv_import_bandwidth": link * speed.load_fraction,
        "kv_export_stall": speed.save_stall,
    }


DEVICES: dict[str, DevicePreset] = {
    d.name: d
    for d in (
        DevicePreset(
            name="a100-80gb",
            kind="gpu",
            description="NVIDIA A100 80GB SXM4",
            memory_bytes=80 * GIB,
            mem_bandwidth=2039 * GB,
            peak_flops=312e12,
            bw_efficiency=0.794,
            flops_efficiency=0.292,
            step_overhead_s=0.0005,
            **handoff(CUDA_CONNECTOR, GEN4_PINNED_D2H),
            swap_bandwidth=PCIE4_X16,
            cores=108,
            numa_nodes=1,
            source="NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e, 2,039 GB/s, "
            "BF16 tensor 312 TFLOPS dense, PCIe Gen4 64 GB/s",
        ),
        DevicePreset(
            name="h100-80gb",
            kind="gpu",
            description="NVIDIA H100 80GB SXM5",
            memory_bytes=80 * GIB,
            mem_bandwidth=3350 * GB,
            peak_flops=989e12,
            bw_efficiency=0.794,
            flops_efficiency=0.292,
            step_overhead_s=0.0005,
            **handoff(CUDA_CONNECTOR, GEN5_PINNED_D2H),
            swap_bandwidth=PCIE5_X16,
            cores=132,
            numa_nodes=1,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM): 80 GB HBM3, 3.35 TB/s, "
            "BF16 tensor 989 TFLOPS dense (1,979 with sparsity), PCIe Gen5 128 GB/s",
        ),
        DevicePreset(
            name="a10-24gb",
            kind="gpu",
            description="NVIDIA A10 24GB (PCIe)",
            memory_bytes=24 * GIB,
            mem_bandwidth=600 * GB,
            peak_flops=125e12,
            bw_efficiency=0.794,
            flops_efficiency=0.292,
            step_overhead_s=0.0005,
            **handoff(CUDA_CONNECTOR, GEN4_PINNED_D2H),
            swap_bandwidth=PCIE4_X16,
            cores=72,
            numa_nodes=1,
            source="NVIDIA A10 Tensor Core GPU datasheet: 24 GB GDDR6, 600 GB/s, "
            "BF16 tensor 125 TFLOPS dense (250 with sparsity), PCIe Gen4 x16, 72 SMs",
        ),
        DevicePreset(
            name="ascend-910b",
            kind="npu",
            description="Huawei Ascend 910B (Atlas 800T A2 module)",
            memory_bytes=64 * GIB,
            mem_bandwidth=1600 * GB,
            peak_flops=313e12,
            bw_efficiency=0.794,
            flops_efficiency=0.292,
            step_overhead_s=0.0008,
            **handoff(CUDA_CONNECTOR, GEN4_PINNED_D2H),
            swap_bandwidth=PCIE4_X16,
            cores=24,
            numa_nodes=1,
            source="Huawei Atlas 800T A2 training server spec sheet: Ascend 910B, 64 GB HBM2e, "
            "1.6 TB/s, ~313 TFLOPS FP16",
        ),
        DevicePreset(
            name="kunpeng-920-7280z",
            kind="cpu",
            description="2x Huawei Kunpeng 920 7280Z, 160 cores, 4 NUMA nodes, 512 GB DDR4",
            memory_bytes=512 * GIB,
            mem_bandwidth=2 * 8 * 25.6 * GB,  # 2 sockets x 8 channels x DDR4-3200
            peak_flops=160 * 2.9e9 * 2 * 64,  # cores x clock x 2 SVE pipes x i8mm int8 ops
            bw_efficiency=0.807,
            flops_efficiency=0.25,
            step_overhead_s=0.001,
            **handoff(CPU_CONNECTOR, CPU_MEMCPY),
            swap_bandwidth=20 * GB,
            cores=160,
            numa_nodes=4,
            source="Huawei Kunpeng 920 product brief: 8 DDR4-3200 channels per socket; "
            "core count, NUMA layout, RAM and ISA (asimd/sve/i8mm) from the sysHAX benchmark "
            "host; peak int8 estimated as cores x 2.9 GHz x 2 x 128-bit i8mm (64 ops/instr)",
        ),
        DevicePreset(
            name="xeon-8480",
            kind="cpu",
            description="2x Intel Xeon Platinum 8480+ (Sapphire Rapids), 112 cores, AMX",
            memory_bytes=1024 * GIB,
            mem_bandwidth=2 * 8 * 38.4 * GB,  # 2 sockets x 8 channels x DDR5-4800
            peak_flops=112 * 2.0e9 * 1024,  # cores x base clock x AMX BF16 FLOP/cycle
            bw_efficiency=0.807,
            flops_efficiency=0.25,
            step_overhead_s=0.001,
            **handoff(CPU_CONNECTOR, CPU_MEMCPY),
            swap_bandwidth=20 * GB,
            cores=112,
            numa_nodes=2,
            source="Intel ARK, Xeon Platinum 8480+: 56 cores, 2.0 GHz base, 8 channels "
            "DDR5-4800, AMX (1,024 BF16 FLOP/cycle/core per Intel's AMX overview)",
        ),
    )
}

MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset(
            name="deepseek-r1-distill-qwen-32b",
            hf_id="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
            quantization="q4_0",
            params=32.76e9,
            bytes_per_param=18 / 32,  # ggml q4_0: 32 weights in 16 nibble bytes + fp16 scale
            layers=64,
            hidden=5120,
            kv_heads=8,
            head_dim=128,
            kv_dtype_bytes=2,
            max_position=131072,
            vocab_size=152064,
            source="config.json of deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (Qwen2.5-32B "
            "architecture); q4_0 block layout from ggml",
        ),
        ModelPreset(
            name="qwen2.5-7b-instruct",
            hf_id="Qwen/Qwen2.5-7B-Instruct",
            quantization="bf16",
            params=7.62e9,
            bytes_per_param=2.0,
            layers=28,
            hidden=3584,
            kv_heads=4,
            head_dim=128,
            kv_dtype_bytes=2,
            max_position=32768,
            vocab_size=152064,
            source="config.json and model card of Qwen/Qwen2.5-7B-Instruct",
        ),
    )
}


def device_preset(name: str) -> DevicePreset:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(
            f"unknown device preset {name!r}; choose one of {sorted(DEVICES)}"
        ) from None


def model_preset(name: str) -> ModelPreset:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODELS)}") from None
