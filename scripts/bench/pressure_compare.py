#!/usr/bin/env python3
"""vLLM 0.32 under KV-cache pressure beside the simulator: the same metric families move
the same way.

Runs one real vLLM engine on this machine's CPU with a KV-heavy tiny model
(``testbed/tiny_model.py --kv-heavy``: 64 KiB of KV per token) and ``VLLM_CPU_KVCACHE_SPACE=1``
(16,384 tokens), and one simulated engine given the same KV capacity in tokens and the same
``--max-num-seqs``, then offers both the same closed-loop load that outgrows the cache. Every
0.25 s it scrapes both engines' ``/metrics`` and prints, per engine:

- the most sequences running and waiting at once;
- the highest ``vllm:kv_cache_usage_perc``;
- ``vllm:num_preemptions_total`` at the end, and whether it grew while the cache was full;
- whether running fell while requests waited (a preempted sequence back in the queue);
- that every request still got exactly its tokens.

docs/simulator.md ("Under memory pressure") has a run's table. Takes 3-5 minutes here:

    .venv/bin/python scripts/bench/pressure_compare.py
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.presets import GIB, model_preset  # noqa: E402
from common.supervisor import free_port  # noqa: E402
from loadgen.client import StreamClient  # noqa: E402
from loadgen.runner import LoadSpec, run_async, run_load  # noqa: E402
from loadgen.wire import ConnectionPool  # noqa: E402
from loadgen.workload import build_requests  # noqa: E402
from testbed.vllm_env import HOME, TINY_MODEL_WRITER, EngineProcess, ensure_vllm  # noqa: E402

KV_TOKENS = 16384  # 1 GiB / 64 KiB per token
MAX_NUM_SEQS = 16
FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
)


@dataclass
class Trace:
    samples: list[dict[str, float]] = field(default_factory=list)

    def add(self, text: str) -> None:
        values = dict.fromkeys(FAMILIES, 0.0)
        for line in text.splitlines():
            for name in FAMILIES:
                if line.startswith(name + "{") or line.startswith(name + " "):
                    values[name] += float(line.rsplit(" ", 1)[1])
        self.samples.append(values)

    def peak(self, name: str) -> float:
        return max((s[name] for s in self.samples), default=0.0)

    def preempted_while_full(self) -> bool:
        for before, after in itertools.pairwise(self.samples):
            grew = after["vllm:num_preemptions_total"] > before["vllm:num_preemptions_total"]
            if grew and max(before["vllm:kv_cache_usage_perc"], after[FAMILIES[2]]) >= 0.9:
                return True
        return False

    def running_fell_while_waiting(self) -> bool:
        for before, after in itertools.pairwise(self.samples):
            if (
                after["vllm:num_requests_running"] < before["vllm:num_requests_running"]
                and after["vllm:num_requests_waiting"] > 0
            ):
                return True
        return False


def scrape(url: str, trace: Trace, stop: threading.Event) -> None:
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                trace.add(client.get(url + "/metrics").text)
            stop.wait(0.25)


def kv_heavy_model() -> Path:
    out = HOME / "tiny-llama-kv-heavy"
    if not (out / "syshax-tiny-model.json").exists():
        writer = [str(ensure_vllm()), str(TINY_MODEL_WRITER), "--kv-heavy", str(out)]
        subprocess.run(writer, check=True)
    return out


def start_vllm(workdir: Path) -> EngineProcess:
    port = free_port()
    argv = [
        str(ensure_vllm()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(kv_heavy_model()), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
        "--max-num-seqs", str(MAX_NUM_SEQS),
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    return EngineProcess("vllm", port, workdir, argv, env)


def start_sim(workdir: Path) -> EngineProcess:
    model = model_preset("qwen2.5-7b-instruct")
    gib = KV_TOKENS * model.kv_bytes_per_token / GIB
    port = free_port()
    argv = [
        sys.executable, "-m", "syshax.cli", "sim", "--device", "xeon-8480",
        "--model", model.name, "--served-model-name", "tiny", "--port", str(port),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "2048",
        "--kv-cache-space", f"{gib:.6f}", "--speed", "4",
    ]  # fmt: skip
    return EngineProcess("sim", port, workdir, argv, dict(os.environ))


def drive(url: str, requests: int, prompt: int, output: int) -> tuple[int, int, float, str]:
    """Closed loop at twice max_num_seqs; returns (requests with exactly ``output`` tokens,
    requests sent, mean prompt tokens as the engine counted them, the errors)."""

    async def go() -> tuple[int, int, float, str]:
        pool = ConnectionPool()
        try:
            client = StreamClient(pool, url, "tiny", api="completions", timeout_s=900)
            specs = build_requests(requests, prompt, output, seed=7)
            result = await run_load(client, specs, LoadSpec(2 * MAX_NUM_SEQS))
        finally:
            pool.close()
        records = result.records
        exact = sum(1 for r in records if r.ok and r.output_tokens == output)
        done = [r.prompt_tokens for r in records if r.ok]
        errors = sorted({(r.error or "").splitlines()[0] for r in records if not r.ok})
        return exact, len(records), sum(done) / max(1, len(done)), "; ".join(errors)

    return run_async(go())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=400, help="words of prompt")
    parser.add_argument("--output-tokens", type=int, default=600)
    args = parser.parse_args()
    rows = []
    prompt_words = args.prompt_tokens
    with tempfile.TemporaryDirectory(prefix="syshax-pressure-") as tmp:
        for start in (start_vllm, start_sim):
            engine = start(Path(tmp))
            try:
                engine.wait_ready()
                trace, stop = Trace(), threading.Event()
                scraper = threading.Thread(target=scrape, args=(engine.url, trace, stop))
                scraper.start()
                began = time.monotonic()
                exact, sent, prompt_mean, errors = drive(
                    engine.url, args.requests, prompt_words, args.output_tokens
                )
                # The simulator counts a word as a token; vLLM's tokenizer splits words, so
                # the simulator gets prompts as long as vLLM counted them.
                prompt_words = round(prompt_mean)
                if errors:
                    errors += "\n" + engine.tail(15)
                took = time.monotonic() - began
                time.sleep(0.5)
                stop.set()
                scraper.join()
                rows.append((engine.name, trace, exact, sent, took, prompt_mean, errors))
            finally:
                engine.stop()
    print(
        f"\n{args.requests} requests of {args.prompt_tokens} + {args.output_tokens} tokens, "
        f"{2 * MAX_NUM_SEQS} at a time; KV cache {KV_TOKENS:,} tokens, "
        f"max_num_seqs {MAX_NUM_SEQS}\n"
    )
    print(
        "| engine | prompt tokens | max running | max waiting | peak KV usage | preemptions | "
        "preempted while KV >= 90% | running fell while waiting | exact answers | wall (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, trace, exact, sent, took, prompt_mean, errors in rows:
        if errors:
            print(f"{name} errors: {errors}", file=sys.stderr)
        print(
            f"| {name} | {prompt_mean:.0f} | {trace.peak(FAMILIES[0]):.0f} | "
            f"{trace.peak(FAMILIES[1]):.0f} | "
            f"{trace.peak(FAMILIES[2]):.3f} | {trace.peak(FAMILIES[3]):.0f} | "
            f"{'yes' if trace.preempted_while_full() else 'no'} | "
            f"{'yes' if trace.running_fell_while_waiting() else 'no'} | "
            f"{exact} / {sent} | {took:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
