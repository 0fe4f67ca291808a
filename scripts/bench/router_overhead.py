"""Measure what the router costs, side by side with hitting the engine directly, in one run.

    .venv/bin/python scripts/bench/router_overhead.py [--quick] [--reps 3] [--workers N] [--json F]

Starts one simulated GPU engine (and a CPU one for the spliced PD figure) and one router,
then measures TTFT straight to the engine and through the router (gpu-only passthrough):

- **steady state** (the target's meaning of "N concurrent streams"): a closed loop of N
  streams, each sending its next request as soon as the previous one ends; output lengths
  vary (uniform 0.5-1.5x a mean, ``ignore_eos``) so the streams drift apart as real ones do.
  Each window warms up first and only requests started inside the measured part count.
  Direct and routed windows alternate (ABBA...) ``--reps`` times so machine noise hits
  both sides alike; the table reports the median over repetitions of each window's p50 and
  p99, the median of the per-repetition differences ("added") and the ratio.
- **burst** (an extra row): N requests released at the same instant, repeatedly.

The load generator is a separate process (a raw keep-alive HTTP/1.1 client on uvloop, this
script with ``--loadgen``) and reports its own CPU use, so it is visibly not the bottleneck.
It then measures the router's CPU seconds per 1000 streamed tokens (from /proc, passthrough
and PD-spliced) and the streamed-token rate with the router pinned to one core.
Figures from a shared 2-core machine are noisy: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
MODEL = "m"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Mean output tokens per concurrency: long enough that the streams overlap and drift
# apart, short enough that a window holds a few hundred requests at sim speed.
MEAN_TOKENS = {1: 4, 16: 16, 64: 32, 256: 32}
DEFAULT_MEAN_TOKENS = 32
# A single stream makes few requests per second; give its windows more time.
MEASURE_SCALE = {1: 3.0, 16: 1.0, 64: 1.0, 256: 1.0}


@dataclass
class Child:
    popen: subprocess.Popen[bytes]
    url: str

    def cpu_seconds(self) -> float:
        total = 0.0
        for pid in [self.popen.pid, *children_of(self.popen.pid)]:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
        return total

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def start(args: list[str], workdir: Path, name: str, pythonpath: str | None = None) -> Child:
    """Start ``syshax ARGS``; with ``pythonpath``, the ``router`` package found there."""
    ready = workdir / f"{name}.port"
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
    # ``python -m`` puts the working directory first on sys.path: running in a directory
    # that holds another copy of the ``router`` package makes that copy the one imported.
    popen = subprocess.Popen(
        [sys.executable, "-m", "syshax.cli", *args, "--port", "0", "--ready-file", str(ready)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=pythonpath or ROOT,
    )
    deadline = time.monotonic() + 30
    while not (ready.exists() and ready.read_text().strip()):
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start; see {workdir / (name + '.log')}")
        time.sleep(0.05)
    return Child(popen, f"http://127.0.0.1:{ready.read_text().strip()}")


# -- the router under gunicorn (--gunicorn), for docs/decisions/0029-router-workers-so-reuseport.md

GUNICORN_ARGV = "ROUTER_OVERHEAD_ROUTER_ARGV"


async def gunicorn_app() -> Any:
    """The app factory gunicorn's aiohttp worker calls once per worker process: the router
    composed from the same flags as ``syshax router`` (``router.cli.compose``), with its
    policy source and scrapes running beside the app."""
    sys.path.insert(0, str(ROOT))
    from router.cli import add_arguments, background, compose  # lazy: after the path is set

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    router_args = parser.parse_args(json.loads(os.environ[GUNICORN_ARGV]))
    router, app, source = await compose(router_args)

    async def lifetime(_: Any) -> Any:
        tasks = background(router, source)
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await router.state.close()

    app.cleanup_ctx.append(lifetime)
    return app


def start_gunicorn(router_args: list[str], workers: int, workdir: Path) -> Child:
    """The router as gunicorn runs it: a master and ``workers`` aiohttp (uvloop) workers
    sharing the master's one listening socket."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    log = open(workdir / "gunicorn.log", "wb")  # noqa: SIM115 - lives as long as the child
    popen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "--chdir",
            str(ROOT / "scripts" / "bench"),
            "-k",
            "aiohttp.GunicornUVLoopWebWorker",
            "-w",
            str(workers),
            "-b",
            f"127.0.0.1:{port}",
            "--backlog",
            "1024",
            "--log-level",
            "warning",
            "router_overhead:gunicorn_app",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, GUNICORN_ARGV: json.dumps(router_args), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gunicorn did not start; see {workdir / 'gunicorn.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if conn.recv(12).startswith(b"HTTP/1.1"):
                    break
        except OSError:
            pass
        time.sleep(0.1)
    time.sleep(1.0)  # every worker booted and scraped once
    return Child(popen, url)


def connection_spread(url: str, connections: int = 64, rounds: int = 7) -> dict[str, Any]:
    """How the kernel (or a shared accept loop) spreads new connections over the workers:
    ``connections`` keep-alive connections opened at once ask ``/health`` which process
    answered; the share of the busiest worker, per round (0.5 is even for two workers)."""

    async def one_round() -> float:
        host, port = urlsplit(url).hostname or "127.0.0.1", urlsplit(url).port or 80

        async def ask() -> tuple[int, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: spread\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            body = json.loads(await reader.readexactly(length))
            return int(body["pid"]), writer  # kept open until every connection answered

        answers = await asyncio.gather(*(ask() for _ in range(connections)))
        for _, writer in answers:
            writer.close()
        pids = [pid for pid, _ in answers]
        return max(pids.count(p) for p in set(pids)) / len(pids)

    shares = [asyncio.run(one_round()) for _ in range(rounds)]
    return {"busiest_worker_share": shares, "median": statistics.median(shares)}


# -- the load generator (its own process) ---------------------------------------------------


class Conn:
    """One keep-alive connection of one stream; a raw client costs the generator little CPU."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, max_tokens: int) -> float:
        """Stream one completion; returns its TTFT (first token event), raises on errors."""
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": "benchmark the router overhead please",
                "stream": True,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
        ).encode()
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        started = time.perf_counter()
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        if not raw.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(raw.split(b"\r\n", 1)[0].decode())
        ttft = 0.0
        tail = b""
        while True:
            data = await self.reader.read(1 << 16)
            if not data:
                raise RuntimeError("connection closed mid-stream")
            if not ttft and b"data:" in data:
                ttft = time.perf_counter() - started
            tail = (tail + data)[-16:]
            if tail.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
                return ttft

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def closed_loop(cmd: dict[str, Any]) -> dict[str, Any]:
    """``streams`` streams, each sending its next request when the last one ends."""
    rng = random.Random(cmd["seed"])
    mean = cmd["mean_tokens"]
    lengths = [max(1, round(mean * rng.uniform(0.5, 1.5))) for _ in range(1 << 14)]
    loop_start = time.perf_counter()
    measure_from = loop_start + cmd["warm"]
    measure_to = measure_from + cmd["measure"]
    ttfts: list[float] = []
    tokens = 0

    async def stream_loop(index: int) -> None:
        nonlocal tokens
        conn = Conn(cmd["url"])
        # Spread the first requests over a little time so the loop starts unsynchronised.
        await asyncio.sleep(rng.uniform(0, cmd.get("spread", 0.05)))
        i = index * 97
        try:
            while True:
                started = time.perf_counter()
                if started >= measure_to:
                    return
                n = lengths[i % len(lengths)]
                i += 1
                ttft = await conn.stream(n)
                if started >= measure_from:
                    ttfts.append(ttft)
                    tokens += n
        finally:
            conn.close()

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    await asyncio.gather(*(stream_loop(k) for k in range(cmd["streams"])))
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - t0
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"ttfts": ttfts, "tokens": tokens, "cpu_s": cpu, "wall_s": wall}


async def burst(cmd: dict[str, Any]) -> dict[str, Any]:
    """``streams`` requests released at the same instant, ``rounds`` times."""
    conns = [Conn(cmd["url"]) for _ in range(cmd["streams"])]
    ttfts: list[float] = []
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    try:
        for _ in range(cmd["rounds"]):
            ttfts += await asyncio.gather(*(c.stream(cmd["mean_tokens"]) for c in conns))
            await asyncio.sleep(0.05)
    finally:
        for c in conns:
            c.close()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"ttfts": ttfts, "tokens": 0, "cpu_s": cpu, "wall_s": time.perf_counter() - t0}


def loadgen_main() -> int:
    """Serve commands (JSON lines on stdin), one result line each on stdout."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            run = closed_loop if cmd["op"] == "closed" else burst
            result = await run(cmd)
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    return 0


class LoadGen:
    def __init__(self) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "--loadgen"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )

    def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write((json.dumps(cmd) + "\n").encode())
        self.popen.stdin.flush()
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError("load generator died")
        result: dict[str, Any] = json.loads(line)
        return result

    def stop(self) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.close()
        self.popen.wait(10)


# -- the floor: a minimal TCP relay (its own process) ----------------------------------------


def relay_main(upstream_port: int, ready_file: str) -> int:
    """Copy bytes both ways between each client and its own engine connection: no HTTP,
    no decisions. Whatever it adds is what any user-space hop costs on this machine."""

    async def main() -> None:
        loop = asyncio.get_running_loop()

        class Up(asyncio.Protocol):
            def __init__(self, down: asyncio.Transport) -> None:
                self.down = down

            def data_received(self, data: bytes) -> None:
                self.down.write(data)

            def connection_lost(self, exc: Exception | None) -> None:
                self.down.close()

        class Down(asyncio.Protocol):
            up: asyncio.Transport | None = None
            early: bytes = b""

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                # uvloop's transports are not asyncio.Transport subclasses, only alike.
                self.transport = cast(asyncio.Transport, transport)
                self.task = loop.create_task(self.connect())

            async def connect(self) -> None:
                up, _ = await loop.create_connection(
                    lambda: Up(self.transport), "127.0.0.1", upstream_port
                )
                self.up = up
                if self.early:
                    up.write(self.early)

            def data_received(self, data: bytes) -> None:
                if self.up is None:
                    self.early += data
                else:
                    self.up.write(data)

            def connection_lost(self, exc: Exception | None) -> None:
                if self.up is not None:
                    self.up.close()

        server = await loop.create_server(Down, "127.0.0.1", 0, backlog=1024)
        port = server.sockets[0].getsockname()[1]
        write_ready(ready_file, port)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    return 0


def write_ready(path: str, port: int) -> None:
    Path(path + ".tmp").write_text(str(port))
    os.replace(path + ".tmp", path)


def start_relay(upstream: str, workdir: Path) -> Child:
    ready = workdir / "relay.port"
    port = urlsplit(upstream).port
    popen = subprocess.Popen([sys.executable, __file__, "--relay", str(port), str(ready)])
    deadline = time.monotonic() + 30
    while not ready.exists():
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("relay did not start")
        time.sleep(0.05)
    return Child(popen, f"http://127.0.0.1:{ready.read_text().strip()}")


# -- statistics and tables -------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(name: str, streams: int, windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions; each window maps a side (direct, router, relay) to its
    load-generator result, plus ``router_cpu_s``."""
    med = statistics.median
    sides = [side for side in ("router", "baseline", "gunicorn", "relay") if side in windows[0]]
    p50 = {s: [pct(w[s]["ttfts"], 0.5) * 1000 for w in windows] for s in ("direct", *sides)}
    p99 = {s: [pct(w[s]["ttfts"], 0.99) * 1000 for w in windows] for s in ("direct", *sides)}
    gen_busy = max(w[s]["cpu_s"] / w[s]["wall_s"] for w in windows for s in ("direct", *sides))
    row: dict[str, Any] = {
        "arrivals": name,
        "streams": streams,
        "reps": len(windows),
        "requests_per_window": med([len(w["direct"]["ttfts"]) for w in windows]),
        "direct_p50_ms": med(p50["direct"]),
        "direct_p99_ms": med(p99["direct"]),
        "loadgen_cpu_busy_max": gen_busy,
    }
    for side in sides:
        served = sum(len(w[side]["ttfts"]) for w in windows)
        row[f"{side}_cpu_ms_per_request"] = (
            1000 * sum(w[f"{side}_cpu_s"] for w in windows) / max(1, served)
        )
        added50 = [r - d for r, d in zip(p50[side], p50["direct"], strict=True)]
        added99 = [r - d for r, d in zip(p99[side], p99["direct"], strict=True)]
        row |= {
            f"{side}_p50_ms": med(p50[side]),
            f"{side}_p99_ms": med(p99[side]),
            f"{side}_added_p50_ms": med(added50),
            f"{side}_added_p99_ms": med(added99),
            f"{side}_added_p50_all_reps_ms": [round(v, 2) for v in added50],
            f"{side}_added_p99_all_reps_ms": [round(v, 2) for v in added99],
            f"{side}_ratio_p50": med(p50[side]) / med(p50["direct"]),
        }
    # The target's names: what the router adds.
    row["added_p50_ms"] = row["router_added_p50_ms"]
    row["added_p99_ms"] = row["router_added_p99_ms"]
    line = (
        f"{name:>6} {streams:>4} streams ({row['requests_per_window']:>4.0f} req/window x "
        f"{len(windows)})  p50 direct {row['direct_p50_ms']:6.2f}"
    )
    for side in sides:
        line += f" {side} {row[f'{side}_p50_ms']:6.2f} ({row[f'{side}_added_p50_ms']:+5.2f})"
    line += f"  p99 direct {row['direct_p99_ms']:6.2f}"
    for side in sides:
        line += f" {side} {row[f'{side}_p99_ms']:6.2f} ({row[f'{side}_added_p99_ms']:+5.2f})"
    line += "  CPU/req" + "".join(
        f" {side} {row[f'{side}_cpu_ms_per_request']:.2f} ms" for side in sides
    )
    line += f"  loadgen busy <= {100 * gen_busy:.0f}%"
    print(line, flush=True)
    return row


def run_windows(
    gen: LoadGen,
    urls: dict[str, str],
    procs: dict[str, Child | None],
    reps: int,
    make_cmd: Any,
) -> list[dict[str, Any]]:
    """``reps`` repetitions of one window per side, the side order rotating each time."""
    windows = []
    names = list(urls)
    for rep in range(reps):
        cmd = make_cmd(rep)  # same seed on every side: identical request sequences
        order = names[rep % len(names) :] + names[: rep % len(names)]
        window: dict[str, Any] = {}
        for side in order:
            child = procs.get(side)
            cpu0 = child.cpu_seconds() if child else 0.0
            window[side] = gen.run(url=urls[side], **cmd)
            if child is not None:
                window[f"{side}_cpu_s"] = child.cpu_seconds() - cpu0
        windows.append(window)
    return windows


def ttft_rows(
    gen: LoadGen,
    urls: dict[str, str],
    procs: dict[str, Child | None],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    rows = []
    for streams in args.concurrency:

        def closed(rep: int, streams: int = streams) -> dict[str, Any]:
            return {
                "op": "closed",
                "streams": streams,
                "mean_tokens": MEAN_TOKENS.get(streams, DEFAULT_MEAN_TOKENS),
                "warm": args.warm,
                "measure": args.measure * MEASURE_SCALE.get(streams, 1.0),
                "seed": rep,
                "spread": 0.2,
            }

        rows.append(summarise("steady", streams, run_windows(gen, urls, procs, args.reps, closed)))

    def burst_cmd(rep: int) -> dict[str, Any]:
        return {"op": "burst", "streams": 64, "mean_tokens": 8, "rounds": args.burst_rounds}

    rows.append(summarise("burst", 64, run_windows(gen, urls, procs, args.reps, burst_cmd)))
    return rows


def throughput(gen: LoadGen, router: Child, seconds: float, streams: int) -> dict[str, float]:
    """Streamed tokens/s through the router and its CPU seconds per 1000 tokens."""
    cpu0 = router.cpu_seconds()
    result = gen.run(
        op="closed",
        url=router.url,
        streams=streams,
        mean_tokens=256,
        warm=0.0,
        measure=seconds,
        seed=7,
    )
    cpu = router.cpu_seconds() - cpu0
    elapsed = result["wall_s"]
    tokens = result["tokens"]
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "router_cpu_s_per_1000_tokens": 1000 * cpu / tokens,
        "router_cpu_utilisation": cpu / elapsed,
        "loadgen_cpu_utilisation": result["cpu_s"] / elapsed,
    }


def throughput_phase(
    tp_router: Child, pd_router: Child, gen: LoadGen, args: argparse.Namespace
) -> dict[str, Any]:
    """Each router process pinned to one core; streamed tokens/s and CPU per token."""
    seconds = 5.0 if args.quick else 10.0
    router_core = {sorted(os.sched_getaffinity(0))[0]}
    for child in (tp_router, pd_router):
        for pid in [child.popen.pid, *children_of(child.popen.pid)]:
            os.sched_setaffinity(pid, router_core)
    print(f"throughput: routers pinned to CPU {sorted(router_core)}", flush=True)
    passthrough = throughput(gen, tp_router, seconds, 64)
    spliced = throughput(gen, pd_router, seconds, 8)
    for name, fig in (
        ("passthrough (gpu-only)", passthrough),
        ("spliced (forced-pd)", spliced),
    ):
        print(
            f"{name:>24}: {fig['tokens_per_s']:8.0f} tok/s streamed, router "
            f"{fig['router_cpu_s_per_1000_tokens'] * 1000:6.2f} ms CPU per 1000 tokens, "
            f"router core {100 * fig['router_cpu_utilisation']:5.1f}% busy -> ceiling "
            f"{1000 / fig['router_cpu_s_per_1000_tokens']:8.0f} tok/s on one core "
            f"(loadgen {100 * fig['loadgen_cpu_utilisation']:.0f}% busy)",
            flush=True,
        )
    return {"passthrough": passthrough, "spliced_pd": spliced}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    (work / "shm").mkdir()
    sim = [
        "--model",
        "deepseek-r1-distill-qwen-32b",
        "--served-model-name",
        MODEL,
        "--shm-dir",
        str(work / "shm"),
        "--log-level",
        "WARNING",
        "--syshax-compat",  # the router's forced-pd speaks sysHAX's protocol
    ]
    children: list[Child] = []
    gen: LoadGen | None = None
    try:
        h100 = ["sim", "--device", "h100-80gb", "--max-num-seqs", "512", *sim]
        gpu = start([*h100, "--speed", str(args.speed)], work, "gpu")
        children.append(gpu)
        # The throughput phase wants token rates no real engine gives one router: compressed.
        fast = ["--speed", str(args.throughput_speed)]
        fast_gpu = start([*h100, *fast], work, "fastgpu")
        children.append(fast_gpu)
        cpu = start(["sim", "--device", "kunpeng-920-7280z", *sim, *fast], work, "cpu")
        children.append(cpu)
        common = ["--model", MODEL, "--cpu-url", cpu.url, "--log-level", "WARNING"]
        workers = ["--workers", str(args.workers)] if args.workers > 1 else []
        router = start(
            ["router", *common, "--gpu-url", gpu.url, *workers, "--mode", "gpu-only"],
            work,
            "router",
        )
        children.append(router)
        tp_router = start(
            ["router", *common, "--gpu-url", fast_gpu.url, "--mode", "gpu-only"],
            work,
            "tprouter",
        )
        children.append(tp_router)
        pd_router = start(
            ["router", *common, "--gpu-url", fast_gpu.url, "--mode", "forced-pd"],
            work,
            "pdrouter",
        )
        children.append(pd_router)
        baseline = None
        if args.baseline:
            baseline = start(
                ["router", *common, "--gpu-url", gpu.url, "--mode", "gpu-only"],
                work,
                "baseline",
                pythonpath=args.baseline,
            )
            children.append(baseline)
        gunicorn = None
        if args.gunicorn:
            gunicorn = start_gunicorn(
                [*common, "--gpu-url", gpu.url, "--mode", "gpu-only"], args.workers, work
            )
            children.append(gunicorn)
        relay = None
        if not args.no_relay:
            relay = start_relay(gpu.url, work)
            children.append(relay)
        gen = LoadGen()
        load = os.getloadavg()
        print(
            f"{len(cores)} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
            f"sim speed {args.speed:g}x (throughput {args.throughput_speed:g}x); "
            f"router workers {args.workers}; "
            f"windows {args.warm:g} s warm-up + {args.measure:g} s measured, {args.reps} reps",
            flush=True,
        )
        for url in (router.url, gpu.url):  # warm both paths
            gen.run(op="closed", url=url, streams=8, mean_tokens=4, warm=0, measure=0.5, seed=9)
        # Background work (engine scrapes each second, the watchdog tick) costs CPU even
        # with no traffic; it is part of "router CPU per request" at low request rates.
        idle0 = router.cpu_seconds()
        time.sleep(3.0)
        idle_ms_per_s = 1000 * (router.cpu_seconds() - idle0) / 3.0
        print(f"router CPU while idle: {idle_ms_per_s:.1f} ms/s", flush=True)
        urls = {"direct": gpu.url, "router": router.url}
        if relay is not None:
            urls["relay"] = relay.url
        if baseline is not None:
            urls["baseline"] = baseline.url
        if gunicorn is not None:
            urls["gunicorn"] = gunicorn.url
        procs = {"router": router, "relay": relay, "baseline": baseline, "gunicorn": gunicorn}
        rows = ttft_rows(gen, urls, procs, args)
        figures = {} if args.no_throughput else throughput_phase(tp_router, pd_router, gen, args)
        if gunicorn is not None:
            spread = {
                "router": connection_spread(router.url),
                "gunicorn": connection_spread(gunicorn.url),
            }
            for side, fig in spread.items():
                print(
                    f"connection spread ({side}, {args.workers} workers, 64 new connections): "
                    f"busiest worker took {100 * fig['median']:.0f}% (median of 7 rounds; "
                    f"{', '.join(f'{100 * v:.0f}' for v in fig['busiest_worker_share'])})",
                    flush=True,
                )
            figures["connection_spread"] = spread
        end_load = os.getloadavg()
        print(f"load average at the end {end_load[0]:.2f} {end_load[1]:.2f} {end_load[2]:.2f}")
        for row in rows:
            if row["streams"] == 64:
                met = row["added_p50_ms"] <= 1.0 and row["added_p99_ms"] <= 5.0
                print(
                    f"target at 64 streams ({row['arrivals']}): added p50 "
                    f"{row['added_p50_ms']:+.2f} ms (<= 1), p99 {row['added_p99_ms']:+.2f} ms "
                    f"(<= 5): {'met' if met else 'NOT met'}"
                )
        return {
            "ttft": rows,
            **figures,
            "speed": args.speed,
            "throughput_speed": args.throughput_speed,
            "workers": args.workers,
            "router_idle_cpu_ms_per_s": idle_ms_per_s,
            "load_average_start": load,
            "load_average_end": end_load,
        }
    finally:
        if gen is not None:
            gen.stop()
        for child in reversed(children):
            child.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    if "--loadgen" in sys.argv[1:]:
        return loadgen_main()
    if len(sys.argv) == 4 and sys.argv[1] == "--relay":
        return relay_main(int(sys.argv[2]), sys.argv[3])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 reps, shorter windows")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="simulator time compression for the TTFT tables (1: real engine timing, so the "
        "router sees a real request rate)",
    )
    parser.add_argument("--throughput-speed", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3)")
    parser.add_argument("--warm", type=float, default=1.0, help="warm-up seconds per window")
    parser.add_argument("--measure", type=float, default=None, help="measured s per window")
    parser.add_argument("--burst-rounds", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1, help="router --workers")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 16, 64, 256],
        help="steady-state stream counts, e.g. 64 or 1,16,64,256 (default)",
    )
    parser.add_argument("--no-throughput", action="store_true", help="TTFT tables only")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also measure the router package found in DIR (e.g. an older version: "
        "mkdir -p DIR; git archive REV | tar -x -C DIR)",
    )
    parser.add_argument(
        "--gunicorn",
        action="store_true",
        help="also measure the router run by gunicorn's aiohttp worker (as many workers as "
        "--workers), beside its own supervisor",
    )
    parser.add_argument(
        "--no-relay", action="store_true", help="skip the minimal TCP relay (floor) column"
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    # SIGTERM ends the run through the finally blocks, so no engine or router is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.reps = args.reps or (2 if args.quick else 3)
    args.measure = args.measure or (2.0 if args.quick else 4.0)
    result = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
