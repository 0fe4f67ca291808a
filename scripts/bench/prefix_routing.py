#!/usr/bin/env python3
"""Prefix-aware against least-loaded replica choice, live (docs/benchmarks.md, "Prefix-aware
replica choice"; decision record 67).

    .venv/bin/python scripts/bench/prefix_routing.py [--replicas 4] [--speed 10]
        [--rates 0.15,0.25,0.35] [--conversations 48] [--seed 1] [--json FILE]

Starts ``--replicas`` GPU + CPU pairs of simulated engines (the ``a10-xeon`` pair of
``hetero.sweep``: an A10 and 56 Xeon 8480 cores, Qwen2.5-7B, the KV connector, prefix caching
on as vLLM has it) and one standalone router in front of all of them (``--deployments-file``),
restarted for each arm with ``--replica-choice prefix`` or ``least-loaded``; every other knob
is the default policy. Two workloads, each at every rate of ``--rates`` (conversations a
simulated second; Poisson arrivals):

- **chat**: ``--conversations`` conversations of 5-10 turns each, every one starting with the
  same 2,000-word system prompt; user messages of 60-140 words, replies of 60-140 tokens
  (``ignore_eos``), a think time of 2 s (mean, exponential) between a reply and the next turn.
  Each turn sends the whole history, as a chat client does.
- **unique**: single-turn requests at the chat workload's turn rate, each prompt 2,000-3,000
  fresh random words (nothing shared), the same reply lengths.

Each run uses a system prompt (or words) of its own and warms every GPU engine with it, so no
run inherits another's cache. For each workload, rate and arm it prints the turns, TTFT p50
and p90 and TPOT p50 (simulated ms), the share of the pair's SLO met (TTFT 2 s, TPOT 100 ms),
goodput (turns meeting it a simulated second), the share of prompt tokens the engines had
cached, the routes, and then the ratios prefix / least-loaded side by side: TTFT p50 (target
at least 3x lower at 70 % of capacity), goodput at equal SLO (the highest rate each arm
serves with 90 % of turns in SLO; target at least 1.3x) and, on the unique workload, goodput
within 2 %.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.supervisor import ReadyChild, python_argv  # noqa: E402
from hetero.live import engine_args  # noqa: E402
from hetero.sweep import PAIRS  # noqa: E402
from loadgen.simproc import running_sim  # noqa: E402
from testbed.vllm_env import connector_config  # noqa: E402

PAIR = PAIRS["a10-xeon"]
MODEL = PAIR.gpu.model.name
ARMS = ("least-loaded", "prefix")
SYSTEM_WORDS = 2000
ATTAINMENT = 0.90  # "at equal SLO": the share of turns in SLO a served rate must keep
WORDS = [f"w{i}" for i in range(3000)]


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tokens: int = 0
    route: str = ""
    error: str | None = None

    def good(self) -> bool:
        return (
            self.error is None
            and self.ttft_ms is not None
            and self.ttft_ms <= PAIR.slo_ttft_ms
            and (self.tpot_ms is None or self.tpot_ms <= PAIR.slo_tpot_ms)
        )


@dataclass
class Run:
    workload: str
    arm: str
    rate: float
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0  # simulated

    def summary(self) -> dict[str, Any]:
        done = [t for t in self.turns if t.ttft_ms is not None]
        ttft = sorted(t.ttft_ms for t in done if t.ttft_ms is not None)
        tpot = sorted(t.tpot_ms for t in done if t.tpot_ms is not None)
        good = sum(t.good() for t in self.turns)
        prompt = sum(t.prompt_tokens for t in self.turns)
        routes: dict[str, int] = {}
        for t in self.turns:
            routes[t.route or "none"] = routes.get(t.route or "none", 0) + 1
        return {
            "workload": self.workload,
            "arm": self.arm,
            "rate": self.rate,
            "turns": len(self.turns),
            "errors": sum(t.error is not None for t in self.turns),
            "ttft_p50_ms": _pct(ttft, 0.5),
            "ttft_p90_ms": _pct(ttft, 0.9),
            "tpot_p50_ms": _pct(tpot, 0.5),
            "attainment": good / len(self.turns) if self.turns else 0.0,
            "goodput": good / self.seconds if self.seconds else 0.0,
            "cached_share": sum(t.cached_tokens for t in self.turns) / prompt if prompt else 0.0,
            "routes": routes,
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# -- the engines and the router --------------------------------------------------------------


class Fleet:
    """``replicas`` engine pairs, each in its own shared-memory directory, and a router."""

    def __init__(self, replicas: int, speed: float) -> None:
        self.replicas = replicas
        self.speed = speed
        self.stack = contextlib.ExitStack()
        self.gpu_urls: list[str] = []
        self.cpu_urls: list[str] = []
        self.tmp = Path(self.stack.enter_context(tempfile.TemporaryDirectory(prefix="pfx-")))

    def __enter__(self) -> Fleet:
        for i in range(self.replicas):
            shm = self.tmp / f"shm{i}"
            shm.mkdir()
            for role, config, urls in (
                ("gpu", PAIR.gpu, self.gpu_urls),
                ("cpu", PAIR.cpu, self.cpu_urls),
            ):
                args = engine_args(PAIR, role, shm, connector_config, "fcfs")
                url = self.stack.enter_context(
                    running_sim(
                        config.device.name, MODEL, speed=self.speed, seed=0, extra_args=args
                    )
                )
                urls.append(url)
        deployments = [
            {
                "name": f"replica-{i}",
                "model": MODEL,
                "gpu_url": self.gpu_urls[i],
                "cpu_url": self.cpu_urls[i],
                "cpu_max_num_seqs": PAIR.cpu.max_num_seqs,
            }
            for i in range(self.replicas)
        ]
        (self.tmp / "deployments.json").write_text(json.dumps({"deployments": deployments}))
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    @contextlib.contextmanager
    def router(self, arm: str) -> Any:
        # The router's clocks run in wall time: its scrape interval shrinks with the speed.
        interval = max(1.0 / self.speed, 0.1)
        argv = python_argv(
            "router", "--deployments-file", str(self.tmp / "deployments.json"),
            "--replica-choice", arm, "--metrics-interval-seconds", f"{interval:g}",
            "--request-timeout-seconds", "600",
        )  # fmt: skip
        with ReadyChild("router", argv, self.tmp, timeout=60) as router:
            yield router.url


# -- the client ------------------------------------------------------------------------------


async def chat_turn(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int,
    turn: Turn, speed: float,
) -> str:  # fmt: skip
    """Send one turn, streamed; fill ``turn`` in simulated ms; return the reply's text."""
    body = {
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            turn.route = response.headers.get("X-Syshax-Route", "")
            if response.status != 200:
                turn.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return ""
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage")
                if usage:
                    turn.prompt_tokens = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    turn.cached_tokens = details.get("cached_tokens") or 0
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        times.append(time.perf_counter())
                        parts.append(text)
    except (aiohttp.ClientError, TimeoutError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
        return ""
    if times:
        turn.ttft_ms = (times[0] - started) * 1000 * speed
        turn.tokens = len(times)
        if len(times) > 1:
            turn.tpot_ms = (times[-1] - times[0]) / (len(times) - 1) * 1000 * speed
    return "".join(parts)


async def conversation(
    session: aiohttp.ClientSession, url: str, index: int, start: float, system: str,
    rng: random.Random, speed: float, single_turn_words: int | None, out: list[Turn],
) -> None:  # fmt: skip
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    if single_turn_words is not None:
        # The run's tag first: no run's prompt shares a chunk with another's.
        tag = system.split(" ", 1)[0]
        messages = [{"role": "user", "content": f"{tag} {words(rng, single_turn_words)}"}]
        turns = 1
    else:
        messages = [{"role": "system", "content": system}]
        turns = rng.randint(5, 10)
    for k in range(turns):
        if single_turn_words is None:
            messages.append({"role": "user", "content": words(rng, rng.randint(60, 140))})
        turn = Turn(index, k)
        out.append(turn)
        reply = await chat_turn(session, url, messages, rng.randint(60, 140), turn, speed)
        if turn.error is not None:
            return
        messages.append({"role": "assistant", "content": reply})
        if k + 1 < turns:
            await asyncio.sleep(rng.expovariate(1 / 2.0) / speed)


async def warm(session: aiohttp.ClientSession, gpu_urls: list[str], system: str) -> None:
    """Every GPU engine computes the run's system prompt once (its cache holds it)."""
    body = {
        "model": MODEL, "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
    }  # fmt: skip
    for url in gpu_urls:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()


async def run_workload(
    url: str, fleet: Fleet, workload: str, arm: str, rate: float, conversations: int, seed: int
) -> Run:
    speed = fleet.speed
    rng = random.Random(seed)
    # The run's own system prompt (its first word names the run), so no run hits another's.
    system = f"run{workload}{arm}{rate}{seed} " + words(random.Random(seed), SYSTEM_WORDS - 1)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if workload == "chat":
            await warm(session, fleet.gpu_urls, system)
        out: list[Turn] = []
        arrivals = random.Random(seed + 1)
        # A conversation has 7.5 turns on average: the unique workload sends as many
        # single-turn requests, at the chat workload's turn rate.
        count = conversations if workload == "chat" else round(conversations * 7.5)
        gap = 1.0 / (rate if workload == "chat" else rate * 7.5)
        at = time.perf_counter() + 0.5
        tasks = []
        for i in range(count):
            at += arrivals.expovariate(1 / gap) / speed
            child = random.Random(rng.random())
            single = child.randint(2000, 3000) if workload == "unique" else None
            tasks.append(conversation(session, url, i, at, system, child, speed, single, out))
        started = time.perf_counter()
        await asyncio.gather(*tasks)
        seconds = (time.perf_counter() - started) * speed
    return Run(workload, arm, rate, out, seconds)


def show(summary: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:8.0f}"

    print(
        f"{summary['workload']:6s} {summary['arm']:12s} rate {summary['rate']:5.2f}  "
        f"turns {summary['turns']:4d} err {summary['errors']:3d}  "
        f"TTFT p50 {ms(summary['ttft_p50_ms'])} p90 {ms(summary['ttft_p90_ms'])}  "
        f"TPOT p50 {ms(summary['tpot_p50_ms'])}  in SLO {summary['attainment']:6.1%}  "
        f"goodput {summary['goodput']:6.3f}/s  cached {summary['cached_share']:5.1%}  "
        f"{summary['routes']}",
        flush=True,
    )


def served_rate(rows: list[dict[str, Any]], arm: str, workload: str) -> float:
    """The highest rate ``arm`` served with ``ATTAINMENT`` of its turns in SLO (0: none)."""
    ok = [r["rate"] for r in rows if r["arm"] == arm and r["workload"] == workload
          and r["attainment"] >= ATTAINMENT]  # fmt: skip
    return max(ok, default=0.0)


def compare(rows: list[dict[str, Any]]) -> None:
    print("\nprefix / least-loaded, side by side in this run:")
    for workload in ("chat", "unique"):
        by = {(r["arm"], r["rate"]): r for r in rows if r["workload"] == workload}
        for rate in sorted({r["rate"] for r in rows if r["workload"] == workload}):
            ll, px = by.get(("least-loaded", rate)), by.get(("prefix", rate))
            if not ll or not px:
                continue
            ratio = (
                ll["ttft_p50_ms"] / px["ttft_p50_ms"]
                if ll["ttft_p50_ms"] and px["ttft_p50_ms"]
                else float("nan")
            )
            goodput = px["goodput"] / ll["goodput"] if ll["goodput"] else float("nan")
            print(
                f"  {workload:6s} rate {rate:5.2f}: TTFT p50 {ratio:5.2f}x lower, "
                f"goodput {goodput:5.3f}x"
            )
        ll_rate, px_rate = (served_rate(rows, arm, workload) for arm in ARMS)
        gain = px_rate / ll_rate if ll_rate else float("nan")
        print(
            f"  {workload:6s} served at {ATTAINMENT:.0%} SLO: least-loaded {ll_rate:.2f}, "
            f"prefix {px_rate:.2f} ({gain:.2f}x)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--speed", type=float, default=10.0)
    parser.add_argument("--rates", default="0.15,0.25,0.35")
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--workloads", default="chat,unique")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows: list[dict[str, Any]] = []
    with Fleet(args.replicas, args.speed) as fleet:
        for workload in args.workloads.split(","):
            for rate in rates:
                # Both arms at each rate back to back, so a busy machine weighs on both alike.
                for arm in ARMS:
                    with fleet.router(arm) as url:
                        run = asyncio.run(
                            run_workload(
                                url, fleet, workload, arm, rate, args.conversations, args.seed
                            )
                        )
                    summary = run.summary()
                    show(summary)
                    rows.append(summary)
                    if args.json:
                        args.json.write_text(json.dumps({"rows": rows, "args": vars(args)},
                                                        default=str, indent=1))  # fmt: skip
    compare(rows)
    if args.json:
        detail = {"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps(detail, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
