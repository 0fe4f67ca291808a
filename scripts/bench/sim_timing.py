"""How accurately does the simulator emit tokens at the times its model schedules?

    .venv/bin/python scripts/bench/sim_timing.py                       # sweep 1..1024 streams
    .venv/bin/python scripts/bench/sim_timing.py --streams 1 64 512 --tokens 100

Starts one ``syshax sim`` at --speed 1 pinned to one core (CPU 0), and a raw-socket asyncio
client pinned to the other. For each stream count N it opens N streaming completions at
once (all in one batch, so every engine step writes N tokens in one burst - the worst case)
and then reads the simulator's own record (/sim/requests): the modelled emission time of
every token (``token_times``) and the moment the simulator wrote it to the socket
(``emitted_times``). The error of a token is emitted - modelled, taken in the steady state
(all N streams in the batch); p99 is of its absolute value. It also reports the client's
arrival error (arrival - modelled), which adds the kernel and this client's own lag.

"Sustained" = the steady-state p99 emission error stays under --limit-ms (2 ms).
``--fifo`` runs the simulator at real-time priority, which shields it from the other
processes of a shared machine (the load average is printed on each row).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from common.supervisor import ReadyChild, python_argv

PROMPT = " ".join(f"t{i}" for i in range(32))


class StreamClient(asyncio.Protocol):
    """One SSE stream; timestamps each received token event."""

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.arrivals: list[float] = []
        self.request_id = ""
        self.pending = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self.pending += data
        if not self.request_id and b'"id":"' in self.pending:
            tail = self.pending.split(b'"id":"', 1)[1]
            if b'"' in tail:
                self.request_id = tail.split(b'"', 1)[0].decode()
        # Token events carry '"text":" ' (a generated word); the finish event has '"text":""'.
        count = self.pending.count(b'"text":" ')
        if count and self.request_id:
            self.arrivals.extend([now] * count)
            self.pending = self.pending[self.pending.rfind(b'"text":" ') + 9 :]
        if b"[DONE]" in self.pending and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_round(port: int, streams: int, tokens: int) -> list[StreamClient]:
    loop = asyncio.get_running_loop()
    body = json.dumps({"prompt": PROMPT, "max_tokens": tokens, "stream": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    clients: list[StreamClient] = []
    for _ in range(streams):
        fut: asyncio.Future[None] = loop.create_future()
        _, proto = await loop.create_connection(lambda f=fut: StreamClient(f), "127.0.0.1", port)  # type: ignore[misc]
        clients.append(proto)
    for c in clients:
        assert c.transport is not None
        c.transport.write(request)
    await asyncio.wait_for(asyncio.gather(*(c.done for c in clients)), timeout=600)
    for c in clients:
        if c.transport is not None:
            c.transport.close()
    return clients


def start_sim(tmp: Path, device: str, model: str, max_seqs: int, fifo: bool) -> ReadyChild:
    cmd = python_argv(
        "sim", "--device", device, "--model", model,
        "--max-num-seqs", str(max_seqs), "--speed", "1", "--log-level", "WARNING",
    )  # fmt: skip
    two_cores = hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1
    sim = ReadyChild("sim", cmd, tmp, cpus={0} if two_cores else None)
    if two_cores:
        os.sched_setaffinity(0, {1})
    if fifo:
        # Real-time priority shields the simulator from other processes on a shared machine.
        os.sched_setscheduler(sim.popen.pid, os.SCHED_FIFO, os.sched_param(10))
    return sim


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 128, 256, 512, 768, 1024])
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--limit-ms", type=float, default=2.0)
    # The fastest preset pair: the shortest steps, so the most tokens per second to write.
    parser.add_argument("--device", default="h100-80gb")
    parser.add_argument("--model", default="qwen2.5-7b-instruct")
    parser.add_argument(
        "--fifo", action="store_true", help="run the simulator at SCHED_FIFO priority (root)"
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        start_sim(Path(tmp), args.device, args.model, max(args.streams), args.fifo) as sim,
    ):
        print(f"{args.model} on {args.device}")
        return sweep(sim.popen.pid, sim.port, args.streams, args.tokens, args.limit_ms)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sweep(pid: int, port: int, counts: list[int], tokens: int, limit_ms: float) -> int:
    url = f"http://127.0.0.1:{port}"
    print(f"simulator at --speed 1 on CPU 0, client on CPU 1; {tokens} tokens per stream")
    print(
        "| streams | tokens | step ms (median) | emission error ms p50 / p99 / max "
        "| sim CPU % | client arrival error ms p50 / p99 "
        "| resyncs | load avg | sustained |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    best = 0
    for n in counts:
        since = time.time()
        late_before = httpx.get(f"{url}/sim/info").json()["late_steps"]
        cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
        clients = asyncio.run(run_round(port, n, tokens))
        cpu_pct = 100 * (cpu_seconds(pid) - cpu_before) / (time.monotonic() - wall_before)
        info = httpx.get(f"{url}/sim/info").json()
        records = httpx.get(f"{url}/sim/requests", params={"since": since}, timeout=60).json()[
            "requests"
        ]
        # Steady state only: from when the last stream got its first token to when the first
        # stream got its last, all N streams are in the batch. (The ramp, when N requests
        # arrive at once, measures HTTP parsing, not the N-stream steady state.)
        start = max(r["token_times"][0] for r in records)
        stop = min(r["token_times"][-1] for r in records)
        emit_err: list[float] = []
        steps: list[float] = []
        for rec in records:
            modelled, emitted = rec["token_times"], rec["emitted_times"]
            emit_err.extend(
                e - m for m, e in zip(modelled, emitted, strict=False) if start < m < stop
            )
            steps.extend(b - a for a, b in itertools.pairwise(modelled))
        by_id = {r["request_id"]: r for r in records}
        arr_err = [
            a - m
            for c in clients
            if c.request_id in by_id
            for m, a in zip(by_id[c.request_id]["token_times"], c.arrivals, strict=False)
            if start < m < stop
        ]
        resyncs = info["late_steps"] - late_before
        p99 = percentile([abs(e) for e in emit_err], 0.99) * 1000
        ok = p99 < limit_ms and len(records) == n
        if ok:
            best = max(best, n)
        print(
            f"| {n} | {len(emit_err)} | {statistics.median(steps) * 1000:.2f} | "
            f"{percentile(emit_err, 0.5) * 1000:.3f} / {p99:.3f} / {max(emit_err) * 1000:.3f} | "
            f"{cpu_pct:.0f} | "
            f"{percentile(arr_err, 0.5) * 1000:.3f} / {percentile(arr_err, 0.99) * 1000:.3f} | "
            f"{resyncs} | {os.getloadavg()[0]:.2f} | {'yes' if ok else 'no'} |"
        )
    print(f"largest stream count sustained with p99 emission error < {limit_ms} ms: {best}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
