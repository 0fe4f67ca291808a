"""Time the router's engine-metrics parser against prometheus_client's, side by side.

    .venv/bin/python scripts/bench/metrics_parse_timing.py [--file METRICS.txt] [--reps 2000]

The router parses every engine's ``/metrics`` on each scrape, on its event loop, so a slow
parse delays every stream it serves. This parses one text (by default the captured
``/metrics`` of a real vLLM 0.32 engine in tests/router/data/, else ``--file``) with
``router.engines.load.parse_metrics_text`` and with ``prometheus_client``'s
``text_string_to_metric_families`` summing the same families, checks that both read the
same numbers, and prints the median time of each and their ratio
(docs/decisions/0026-router-parses-engine-metrics.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from router.engines.load import WANTED_METRICS, parse_metrics_text  # noqa: E402

CAPTURED = ROOT / "tests" / "router" / "data" / "vllm-0.32-metrics.txt"


def with_prometheus_client(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WANTED_METRICS:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def median_us(parse: Callable[[str], object], text: str, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        parse(text)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=CAPTURED)
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    text = args.file.read_text()
    ours = parse_metrics_text(text, 0.0)
    theirs = with_prometheus_client(text)
    # The same numbers: each family ours reads, theirs sums alike.
    for name, value in (
        ("vllm:num_requests_running", ours.running),
        ("vllm:num_requests_waiting", ours.waiting),
        ("vllm:generation_tokens_total", ours.generation_tokens),
        ("vllm:inter_token_latency_seconds_count", ours.itl_count),
    ):
        if name in theirs and theirs[name] != value:
            print(f"MISMATCH {name}: ours {value}, prometheus_client {theirs[name]}")
            return 1
    lines = len(text.splitlines())
    fast = median_us(lambda t: parse_metrics_text(t, 0.0), text, args.reps)
    slow = median_us(with_prometheus_client, text, max(1, args.reps // 10))
    print(f"{args.file.name}: {len(text)} bytes, {lines} lines, same numbers from both parsers")
    print(f"  router.engines.load     median {fast:9.1f} us per scrape")
    print(f"  prometheus_client       median {slow:9.1f} us per scrape")
    print(f"  ratio                   {slow / fast:9.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
