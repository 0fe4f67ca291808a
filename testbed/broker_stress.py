"""Many producers and consumers on one embedded-broker folder: count what is lost, duplicated
or corrupt.

Each producer process publishes its share of numbered messages (a body with a checksum), and
each consumer process takes messages until the queue stays empty, writing what it got to its own
file. ``run()`` gives the figures of one transport: kombu's own ``filesystem://`` or
``syshaxfs://`` (controlplane/core/broker.py). scripts/bench/broker_stress.py prints them side
by side; tests/broker runs the same with assertions.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import controlplane.core.broker  # noqa: F401 - registers syshaxfs://

QUEUE = "stress"


def _options(folder: Path) -> dict[str, Any]:
    return {
        "data_folder_in": str(folder / "queue"),
        "data_folder_out": str(folder / "queue"),
        "processed_folder": str(folder / "processed"),
        "control_folder": str(folder / "control"),
        "polling_interval": 0.01,
    }


def _body(number: int) -> dict[str, Any]:
    text = f"message {number} " + "x" * (number % 512)
    return {"n": number, "text": text, "sha": hashlib.sha256(text.encode()).hexdigest()}


def _produce(transport: str, folder: Path, numbers: range) -> None:
    from kombu import Connection

    with Connection(f"{transport}://", transport_options=_options(folder)) as conn:
        queue = conn.SimpleQueue(QUEUE)
        for number in numbers:
            queue.put(_body(number))
        queue.close()


def _consume(transport: str, folder: Path, out: Path, idle_seconds: float) -> None:
    from kombu import Connection

    got: list[Any] = []
    errors = 0
    with Connection(f"{transport}://", transport_options=_options(folder)) as conn:
        queue = conn.SimpleQueue(QUEUE)
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < idle_seconds:
            try:
                message = queue.get(block=True, timeout=0.05)
            except queue.Empty:
                continue
            except Exception:
                errors += 1
                idle_since = time.monotonic()
                continue
            idle_since = time.monotonic()
            got.append(message.payload)
            message.ack()
        queue.close()
    out.write_text(json.dumps({"got": got, "errors": errors}))


@dataclass
class Figures:
    transport: str
    messages: int
    received: int
    lost: int
    duplicated: int
    corrupt: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.received / self.seconds if self.seconds else 0.0


def run(transport: str, messages: int = 10_000, producers: int = 4, consumers: int = 3) -> Figures:
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix=f"broker-{transport}-") as tmp:
        folder = Path(tmp)
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir()
        share = -(-messages // producers)
        started = time.monotonic()
        workers = [
            context.Process(target=_consume, args=(transport, folder, folder / f"c{i}.json", 3.0))
            for i in range(consumers)
        ] + [
            context.Process(
                target=_produce,
                args=(transport, folder, range(i * share, min(messages, (i + 1) * share))),
            )
            for i in range(producers)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=600)
        elapsed = time.monotonic() - started - 3.0  # less the consumers' final idle wait
        seen: dict[int, int] = {}
        corrupt = 0
        for i in range(consumers):
            path = folder / f"c{i}.json"
            result = json.loads(path.read_text()) if path.exists() else {"got": [], "errors": 1}
            corrupt += int(result["errors"])
            for body in result["got"]:
                ok = isinstance(body, dict) and hashlib.sha256(
                    str(body.get("text", "")).encode()
                ).hexdigest() == body.get("sha")
                if not ok:
                    corrupt += 1
                    continue
                seen[int(body["n"])] = seen.get(int(body["n"]), 0) + 1
        received = sum(seen.values())
        return Figures(
            transport=transport,
            messages=messages,
            received=received,
            lost=sum(1 for n in range(messages) if n not in seen),
            duplicated=sum(count - 1 for count in seen.values() if count > 1),
            corrupt=corrupt,
            seconds=max(elapsed, 1e-6),
        )
