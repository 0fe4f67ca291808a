#!/usr/bin/env python3
"""What the gateway's limits cost: uvicorn's httptools protocol with and without them.

    .venv/bin/python scripts/bench/gateway_edge_bench.py --rounds 3 --seconds 5 --connections 50

Each round starts a server process per variant, one after the other, that answers a
heartbeat-sized POST (``asgi_app`` over a handler that reads the fields the gateway reads,
as the gateway's answers do) on uvloop: ``uvicorn`` runs uvicorn's ``HttpToolsProtocol``,
``edge`` the gateway's ``EdgeProtocol`` (controlplane/gateway/edge.py). A client process
keeps ``--connections`` keep-alive connections busy for ``--seconds``; the server's CPU
seconds over that time, divided by the requests answered, is its cost a request. It prints
each run and the medians. Django-free: no database is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BODY = json.dumps(
    {
        "cpu_percent": 12.5,
        "memory_used_bytes": 3 * 2**30,
        "accelerators": [
            {"uuid": f"GPU-{i}", "utilization_percent": 40, "temperature_c": 61.0} for i in range(8)
        ],
    }
).encode()
REQUEST = (
    b"POST /api/v1/nodes/17/heartbeat HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
    b"User-Agent: syshax-agent/0.1\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
    b"Connection: keep-alive\r\nAuthorization: Bearer " + b"x" * 43 + b"\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
) + BODY
ANSWER = b'{"status":"online","inventory_hash":"abc","heartbeat_interval_seconds":10}'
FIELDS = (("Content-Type", "application/json"), ("X-Content-Type-Options", "nosniff"))


def serve(variant: str, port: int) -> None:
    # lazy: the server process alone needs the server's code
    import functools

    import uvicorn
    import uvloop

    from controlplane.gateway.edge import Edge, EdgeLimits, EdgeProtocol, asgi_app

    async def handler(request: object, reply: object) -> None:
        request.header("authorization")  # type: ignore[attr-defined]
        _ = request.content_type, len(request.body)  # type: ignore[attr-defined]
        await reply.send(200, FIELDS, ANSWER)  # type: ignore[attr-defined]

    edge = Edge(EdgeLimits(max_body=2 * 1024 * 1024, read_timeout=10.0))
    protocol = functools.partial(EdgeProtocol, edge=edge) if variant == "edge" else "httptools"
    config = uvicorn.Config(
        asgi_app(handler),  # type: ignore[arg-type]
        host="127.0.0.1",
        port=port,
        http=protocol,  # type: ignore[arg-type]
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        backlog=4096,
    )
    uvloop.run(uvicorn.Server(config).serve())


async def load(port: int, seconds: float, connections: int) -> int:
    answered = 0
    stop = time.monotonic() + seconds

    async def one() -> None:
        nonlocal answered
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < stop:
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            at = head.index(b"content-length:") + 15
            await reader.readexactly(int(head[at : head.index(b"\r\n", at)]))
            answered += 1
        writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    return answered


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    import uvloop

    from common.supervisor import free_port  # lazy: after sys.path names the checkout

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--connections", type=int, default=50)
    p.add_argument("--serve", nargs=2, metavar=("VARIANT", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    runs: dict[str, list[tuple[float, float]]] = {"uvicorn": [], "edge": []}
    for _ in range(args.rounds):
        for variant, done in runs.items():
            port = free_port()
            server = subprocess.Popen([sys.executable, __file__, "--serve", variant, str(port)])
            try:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        uvloop.run(load(port, 0.5, 4))  # and warm up
                        break
                    except OSError:
                        assert time.monotonic() < deadline, "the server did not listen"
                        time.sleep(0.2)
                before, started = cpu_seconds(server.pid), time.monotonic()
                answered = uvloop.run(load(port, args.seconds, args.connections))
                used, took = cpu_seconds(server.pid) - before, time.monotonic() - started
            finally:
                server.terminate()
                server.wait()
            done.append((answered / took, used / answered * 1e6))
            print(f"{variant}: {answered / took:.0f} a second, {done[-1][1]:.1f} us CPU each")
    print(f"\nmedians of {args.rounds}, alternating:")
    for variant, done in runs.items():
        rate = statistics.median(r for r, _ in done)
        cost = statistics.median(c for _, c in done)
        print(f"  {variant}: {rate:.0f} answers a second, {cost:.1f} us of server CPU each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
