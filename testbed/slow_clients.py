"""Slow clients against ``syshax web``: how long ``/api/v1/health`` takes while they hold on.

``serving()`` starts ``syshax web`` with one worker class as the stack runs it (2 workers x 4
threads, on the embedded SQLite in a fresh directory) on a free loopback port. ``attack()``
then opens the slow clients, on 127.0.0.1 only. A slow body sends a whole head announcing a
1000 byte form body (to the admin login, with a well-formed CSRF cookie, so Django reads that
body) and then one byte of it a second. A slow head sends a request line and then one byte of
a header a second. Each one the server closes is opened again at once, as an attacker would.
Meanwhile a client asks for ``/api/v1/health`` on a new connection, one request after another
(each waits at most 10 s). ``report()`` gives the health latency (median, 90th percentile,
worst), the probes left unanswered, and how long the slow connections were held. Everything
stops after ``seconds``. scripts/bench/slow_clients.py prints the figures of several worker
classes side by side; tests/controlplane/webworker/test_web_slow_clients.py runs the same
clients with assertions.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from common.supervisor import free_port, python_argv, wait_until

ROOT = Path(__file__).resolve().parents[1]

HOST = "127.0.0.1"
PROBE_TIMEOUT = 10.0
BODY_BYTES = 1000
SLOW_BODY_HEAD = (
    "POST /admin/login/ HTTP/1.1\r\n"
    f"Host: {HOST}\r\n"
    "Content-Type: application/x-www-form-urlencoded\r\n"
    "Cookie: csrftoken=abcdefghijklmnopqrstuvwxyz012345\r\n"
    f"Content-Length: {BODY_BYTES}\r\n\r\n"
).encode()
SLOW_HEAD_START = f"GET /api/v1/health HTTP/1.1\r\nHost: {HOST}\r\nX-Slow: ".encode()
HEALTH_REQUEST = f"GET /api/v1/health HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n"


@dataclass
class Held:
    """One slow connection: when it opened and closed, and the status it was answered."""

    kind: str
    opened: float
    closed: float | None = None
    status: int | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.closed is None else self.closed - self.opened


@dataclass
class Figures:
    probes: list[float | None] = field(default_factory=list)  # None: no answer in time
    held: list[Held] = field(default_factory=list)

    @property
    def answered(self) -> list[float]:
        return [p for p in self.probes if p is not None]


def status_of(answer: bytes) -> int | None:
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


async def _hold(kind: str, port: int, stop_at: float, interval: float, held: list[Held]) -> None:
    """Open slow connections of one kind one after another until ``stop_at``."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        record = Held(kind, time.monotonic())
        held.append(record)
        answer = asyncio.ensure_future(reader.read(200))
        try:
            writer.write(SLOW_BODY_HEAD if kind == "body" else SLOW_HEAD_START)
            sent = 0
            while loop.time() < stop_at and not answer.done():
                await asyncio.wait([answer], timeout=interval)
                if answer.done() or (kind == "body" and sent >= BODY_BYTES - 1):
                    continue
                writer.write(b"x")  # never the last byte of the body, nor the end of the head
                sent += 1
                with suppress(ConnectionError):
                    await writer.drain()
            if answer.done():
                record.closed = time.monotonic()
                with suppress(OSError, asyncio.CancelledError):
                    record.status = status_of(answer.result())
        except OSError:
            record.closed = time.monotonic()
        finally:
            answer.cancel()
            writer.close()
            with suppress(OSError):
                await writer.wait_closed()


async def _probe(port: int) -> float | None:
    started = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), PROBE_TIMEOUT)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(HEALTH_REQUEST.encode())
        remaining = PROBE_TIMEOUT - (time.monotonic() - started)
        answer = await asyncio.wait_for(reader.read(200), max(remaining, 0.01))
        return time.monotonic() - started if status_of(answer) == 200 else None
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()


async def _attack(
    port: int, *, slow_bodies: int, slow_heads: int, seconds: float, interval: float
) -> Figures:
    figures = Figures()
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds
    holders = [
        asyncio.ensure_future(_hold(kind, port, stop_at, interval, figures.held))
        for kind, count in (("body", slow_bodies), ("head", slow_heads))
        for _ in range(count)
    ]
    await asyncio.sleep(1.0)  # every slow client is connected and has started sending
    while loop.time() < stop_at:
        figures.probes.append(await _probe(port))
        await asyncio.sleep(0.2)
    await asyncio.gather(*holders)
    return figures


def attack(
    port: int,
    *,
    slow_bodies: int = 40,
    slow_heads: int = 40,
    seconds: float = 20.0,
    interval: float = 1.0,
) -> Figures:
    """Hold the slow clients on ``port`` for ``seconds`` while probing health."""
    return asyncio.run(
        _attack(
            port, slow_bodies=slow_bodies, slow_heads=slow_heads, seconds=seconds, interval=interval
        )
    )


def health_answers(port: int) -> bool:
    return asyncio.run(_probe(port)) is not None


@contextmanager
def serving(worker_class: str, read_timeout: float, var_dir: Path) -> Iterator[int]:
    """``syshax web`` with that worker class on the embedded defaults; yields its port."""
    port = free_port()
    env = {
        **os.environ,
        "SYSHAX_VAR_DIR": str(var_dir),
        "SYSHAX_ENV_FILE": str(var_dir / "none.env"),
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
    }
    argv = python_argv(
        "web",
        "--bind",
        f"{HOST}:{port}",
        "--worker-class",
        worker_class,
        "--read-timeout",
        str(read_timeout),
    )
    with (var_dir / f"web-{worker_class}.log").open("wb") as log:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_until(lambda: health_answers(port), 120, f"syshax web ({worker_class})")
            yield port
        finally:
            process.terminate()
            with suppress(subprocess.TimeoutExpired):
                process.wait(15)
            if process.poll() is None:
                process.kill()
                process.wait(5)


def _ms(value: float) -> str:
    return (
        f">={PROBE_TIMEOUT * 1000:.0f} ms" if value >= PROBE_TIMEOUT else f"{value * 1000:.0f} ms"
    )


def report(worker_class: str, figures: Figures) -> str:
    """One worker class's figures; a probe left unanswered counts as the probe timeout."""
    latencies = sorted(PROBE_TIMEOUT if p is None else p for p in figures.probes)
    missed = sum(p is None for p in figures.probes)
    closed = [h.seconds for h in figures.held if h.seconds is not None]
    statuses = sorted({h.status for h in figures.held if h.status is not None})
    lines = [
        f"{worker_class}",
        f"  health: {len(latencies)} probes, {missed} unanswered within {PROBE_TIMEOUT:g} s; "
        f"median {_ms(statistics.median(latencies))}, "
        f"p90 {_ms(latencies[int(0.9 * (len(latencies) - 1))])}, worst {_ms(latencies[-1])}",
        f"  slow connections: {len(figures.held)} opened, {len(closed)} closed by the server",
    ]
    if closed:
        lines[-1] += f" after {statistics.median(closed):.1f} s (median), answered {statuses}"
    return "\n".join(lines)
