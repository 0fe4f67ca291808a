# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

"""``syshax gateway``: the machine gateway in front of ``syshax web`` (docs/scale.md)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

from controlplane.webworker import limits_from_env


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return host, int(port)


def _seconds(low: float, high: float) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            seconds = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
        if not low <= seconds <= high:
            raise argparse.ArgumentTypeError(f"{value!r} must be between {low:g} and {high:g}")
        return seconds

    return parse


def _count(low: int, high: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not value.isdigit() or not low <= int(value) <= high:
            raise argparse.ArgumentTypeError(
                f"{value!r} must be a whole number from {low} to {high}"
            )
        return int(value)

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bind", type=_host_port, default=("127.0.0.1", 8000), help="HOST:PORT to listen on"
    )
    parser.add_argument(
        "--upstream",
        default="http://127.0.0.1:8001",
        help="the control plane's own address (`syshax web --bind`), default %(default)s",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=_seconds(0.05, 5.0),
        default=0.25,
        help="seconds between reads of what routers and idle agents poll for (default 0.25)",
    )
    parser.add_argument(
        "--credential-ttl",
        type=_seconds(0.0, 3600.0),
        help="seconds a machine token's lookup is kept at most (default: "
        "TOKEN_LAST_USED_SECONDS); any change to a credential (issued, moved, revoked, "
        "deleted) drops them all at the next snapshot",
    )
    parser.add_argument(
        "--switch-interval",
        type=_seconds(0.0001, 0.1),
        default=0.0005,
        help="seconds the event loop holds Python's GIL before a database thread gets it "
        "(default 0.0005; Python's own is 0.005)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=_seconds(1.0, 3600.0),
        default=20.0,
        help="seconds a connection may wait for its next request, its first included "
        "(default 20, over the machines' own clients' keep-alive)",
    )
    parser.add_argument(
        "--max-connections",
        type=_count(16, 1_000_000),
        default=16_384,
        help="open client connections at most (default 16384; fewer if the open-file limit "
        "leaves no room): one more closes the one idle longest",
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from syshax.commands._django import setup

    setup()
    import uvloop

    from controlplane.gateway.server import serve

    uvloop.install()
    host, port = args.bind
    serve(
        host,
        port,
        args.upstream,
        snapshot_interval=args.snapshot_interval,
        credential_ttl=args.credential_ttl,
        switch_interval=args.switch_interval,
        read_timeout=limits_from_env(os.environ).timeout,
        idle_timeout=args.idle_timeout,
        max_connections=args.max_connections,
    )
    return 0
