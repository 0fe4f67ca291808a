"""``syshax router``: the OpenAI-compatible PD router, standalone or managed.

The composition root: the flags, the policy source they ask for (``router.policy``), the
app (``router.api``) and what runs beside it (the source, the engine scrapes), wired
together in ``compose`` and ``background``; ``--workers N`` hands over to the supervisor
(``router.workers``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

from aiohttp import web

from common.files import write_ready_file
from common.policy_schema import KNOBS, PolicyError
from common.routing import PD_PROTOCOLS, DeploymentSpec
from common.tenants import TenantError
from common.tracing import TracingError, traces_endpoint
from router.api.app import build_app
from router.client.access import MODE_HEADER_OFF, MODE_HEADER_POLICIES
from router.client.shared_limits import DEFAULT_TIMEOUT
from router.engines.backends import Timeouts
from router.engines.scrape import scrape_forever
from router.policy.deployments_file import load_deployments_file
from router.policy.managed import ControlPlaneClient
from router.policy.source import PolicySource
from router.policy.standalone import StandalonePolicy, load_tenants_file
from router.state import Router, ServerConfig
from router.tracing import start as start_tracing
from router.workers import supervise

log = logging.getLogger("syshax.router")

# The benchmark keys' environment variable: the router's list, and the key the benchmark
# client (syshax benchmark) sends.
BENCHMARK_KEY_ENV = "SYSHAX_ROUTER_BENCHMARK_KEY"
MODE_HEADER_ENV = "SYSHAX_ROUTER_MODE_HEADER"
METRICS_TOKEN_ENV = "SYSHAX_ROUTER_METRICS_TOKEN"
SHARED_LIMITS_ENV = "SYSHAX_ROUTER_SHARED_LIMITS_URL"


def parse_size(text: str) -> int:
    units = {
        "kb": 1024,
        "mb": 1024**2,
        "gb": 1024**3,
        "k": 1024,
        "m": 1024**2,
        "g": 1024**3,
        "b": 1,
    }
    lowered = text.strip().lower()
    for suffix, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7010, help="0 picks a free port")
    parser.add_argument("--ready-file", help="write the bound port here once listening")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SYSHAX_ROUTER_API_KEY"),
        help="require 'Authorization: Bearer KEY' from clients",
    )
    parser.add_argument(
        "--metrics-token",
        default=os.environ.get(METRICS_TOKEN_ENV),
        help="require 'Authorization: Bearer TOKEN' on /metrics, which then lists the "
        "per-tenant series; without one /metrics is open and leaves them out (default: env "
        f"{METRICS_TOKEN_ENV}; must differ from the API and benchmark keys)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default=10 * 1024**2,
        help="largest request body, e.g. 10MB (default)",
    )
    parser.add_argument(
        "--benchmark-key",
        dest="benchmark_keys",
        action="append",
        default=None,
        metavar="KEY",
        help=f"a key that gets in like --api-key and may force a policy mode per request with "
        f"X-Syshax-Mode (repeatable; default: env {BENCHMARK_KEY_ENV}, comma-separated)",
    )
    parser.add_argument(
        "--mode-header",
        choices=MODE_HEADER_POLICIES,
        default=os.environ.get(MODE_HEADER_ENV) or MODE_HEADER_POLICIES[0],
        help="who may force a policy mode with X-Syshax-Mode: benchmark-keys (default; "
        "others get a 403), all (every client), off (the header is ignored)",
    )
    parser.add_argument(
        "--no-mode-header",
        dest="mode_header",
        action="store_const",
        const=MODE_HEADER_OFF,
        help="the same as --mode-header off",
    )
    parser.add_argument(
        "--shared-limits-url",
        default=os.environ.get(SHARED_LIMITS_ENV) or None,
        help="a Redis (redis://[:PASSWORD@]HOST:6379/0) the tenants' RPM/TPM limits are shared "
        "through, by every router process and replica; without one each process holds its "
        f"own (default: env {SHARED_LIMITS_ENV})",
    )
    parser.add_argument(
        "--shared-limits-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds an admission waits for that Redis before the router holds the limits "
        f"locally, divided by the routers it last saw (default {DEFAULT_TIMEOUT})",
    )
    parser.add_argument("--connect-timeout", type=float, default=3.0)
    parser.add_argument("--first-byte-timeout", type=float, default=120.0)
    parser.add_argument(
        "--idle-timeout", type=float, default=30.0, help="longest silence inside an upstream stream"
    )
    parser.add_argument(
        "--eject-base-seconds",
        type=float,
        default=1.0,
        help="first outlier ejection lasts this long, doubling per ejection up to 30 s",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--otlp-traces-endpoint",
        help="trace each request with OpenTelemetry and send the spans to this OTLP/HTTP "
        "collector URL, e.g. http://127.0.0.1:4318/v1/traces (default: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; none: off). "
        "docs/tracing.md",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="router processes sharing the port with SO_REUSEPORT (standalone mode; each "
        "keeps its own metrics). Default 1",
    )
    # Set by the --workers supervisor on each worker: bind with SO_REUSEPORT.
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    alone = parser.add_argument_group("standalone mode")
    alone.add_argument(
        "--deployments-file",
        help="the deployments to route to, replicas included (the control plane's "
        "routing/deployments document, JSON or YAML), in place of --gpu-url/--cpu-url/--model; "
        "reloaded on change or SIGHUP",
    )
    alone.add_argument("--gpu-url", help="GPU/NPU engine, e.g. http://127.0.0.1:7001")
    alone.add_argument("--cpu-url", help="CPU engine, e.g. http://127.0.0.1:7002")
    alone.add_argument("--model", help="served model name (default: ask the GPU engine)")
    alone.add_argument(
        "--pd-protocol",
        choices=PD_PROTOCOLS,
        default=None,
        help="vllm (default): upstream vLLM with the KV connector; syshax: sysHAX's patched V0 "
        "engines",
    )
    alone.add_argument(
        "--priority-scheduling",
        action="store_true",
        help="the engines run with --scheduling-policy priority: each request carries its SLO "
        "class's priority (docs/slo-classes.md)",
    )
    alone.add_argument("--policy", help="policy file (JSON or YAML); reloaded on change or SIGHUP")
    alone.add_argument(
        "--tenants-file",
        help="tenants and their keys' SHA-256 (the control plane's routing/tenants document, "
        "JSON or YAML); reloaded on change or SIGHUP. Managed routers pull theirs",
    )
    knobs = parser.add_argument_group("policy knobs (override the policy file)")
    for knob in KNOBS:
        flag = "--" + knob.name.replace("_", "-")
        extra: dict[str, Any] = {"choices": knob.choices} if knob.choices else {}
        knobs.add_argument(
            flag,
            dest=f"knob_{knob.name}",
            default=None,
            metavar=knob.name.upper() if not knob.choices else None,
            help=f"{knob.meaning} (default {knob.default})".replace("%", "%%"),
            **extra,
        )
    managed = parser.add_argument_group("managed mode")
    managed.add_argument("--control-plane", help="control plane base URL")
    managed.add_argument(
        "--token", default=os.environ.get("SYSHAX_ROUTER_TOKEN"), help="router token (sxr_...)"
    )
    managed.add_argument("--name", default=socket.gethostname(), help="router name to register")
    managed.add_argument(
        "--advertise-url",
        help="URL clients reach this router at, sent on register (default http://HOST:PORT)",
    )
    managed.add_argument(
        "--state-dir",
        default=os.environ.get("SYSHAX_ROUTER_STATE_DIR", "var/router"),
        help="where the last good policy and deployments are kept",
    )
    managed.add_argument("--poll-interval", type=float, default=0.5)
    managed.add_argument("--stats-interval", type=float, default=10.0)


def _flag_knobs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        knob.name: getattr(args, f"knob_{knob.name}")
        for knob in KNOBS
        if getattr(args, f"knob_{knob.name}") is not None
    }


class StartupError(Exception):
    """The router cannot start as configured; the message says what to change."""


async def discover_model(gpu_url: str) -> str | None:
    import aiohttp

    for _ in range(10):
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session,
                session.get(gpu_url.rstrip("/") + "/v1/models") as resp,
            ):
                data = await resp.json()
                return str(data["data"][0]["id"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError):
            await asyncio.sleep(0.5)
    return None


def bound_port(site: web.TCPSite, requested: int) -> int:
    server = site._server
    sockets = getattr(server, "sockets", None)
    if sockets:
        return int(sockets[0].getsockname()[1])
    return requested


async def _policy_source(router: Router, args: argparse.Namespace) -> PolicySource:
    """The policy source the flags ask for, with the standalone deployment set up."""
    if args.control_plane:
        if not args.token:
            raise StartupError("--control-plane needs --token (or SYSHAX_ROUTER_TOKEN)")
        if _flag_knobs(args):
            log.warning("knob flags are ignored in managed mode; the control plane owns policy")
        if args.tenants_file:
            log.warning("--tenants-file is ignored in managed mode; the control plane owns tenants")
        if args.deployments_file:
            raise StartupError(
                "--deployments-file is for standalone mode; a managed router routes to the "
                "control plane's deployments"
            )
        return ControlPlaneClient(
            router,
            base_url=args.control_plane,
            token=args.token,
            name=args.name,
            state_dir=Path(args.state_dir),
            poll_interval=args.poll_interval,
            stats_interval=args.stats_interval,
        )
    if args.deployments_file:
        _check_deployments_file_alone(args)
    elif not args.gpu_url and not args.cpu_url:
        raise StartupError(
            "standalone mode needs --gpu-url (and usually --cpu-url) or --deployments-file, "
            "or use --control-plane URL --token TOKEN"
        )
    standalone = StandalonePolicy(
        router, args.policy, _flag_knobs(args), args.tenants_file, args.deployments_file
    )
    try:
        router.state.set_policy(standalone.load())
    except (PolicyError, OSError, ValueError) as exc:
        raise StartupError(f"invalid policy: {exc}") from None
    if args.policy:
        standalone.mtime = os.stat(args.policy).st_mtime_ns
    if args.tenants_file:
        try:
            router.tenants.set_records(load_tenants_file(args.tenants_file))
        except (TenantError, OSError, ValueError) as exc:
            raise StartupError(f"invalid tenants file {args.tenants_file}: {exc}") from None
        standalone.tenants_mtime = os.stat(args.tenants_file).st_mtime_ns
    if args.deployments_file:
        _load_deployments_file(standalone, args.deployments_file)
        return standalone
    model = args.model or await discover_model(args.gpu_url or args.cpu_url)
    if model is None:
        raise StartupError("could not ask the GPU engine for its model name; pass --model")
    router.state.set_deployments(
        [
            DeploymentSpec(
                id=0,
                name="standalone",
                model=model,
                policy="default",
                pd_protocol=args.pd_protocol or "vllm",
                gpu_url=args.gpu_url or args.cpu_url,
                cpu_url=args.cpu_url,
                priority_scheduling=args.priority_scheduling,
            )
        ]
    )
    return standalone


def _check_deployments_file_alone(args: argparse.Namespace) -> None:
    """Raise StartupError where flags describing the one flag-built deployment come with a
    deployments file, which describes every deployment itself."""
    given = [
        flag
        for flag, value in (
            ("--gpu-url", args.gpu_url),
            ("--cpu-url", args.cpu_url),
            ("--model", args.model),
            ("--pd-protocol", args.pd_protocol),
            ("--priority-scheduling", args.priority_scheduling),
        )
        if value
    ]
    if given:
        raise StartupError(
            f"--deployments-file lists each deployment's engines, model, pd_protocol and "
            f"priority_scheduling; leave out {', '.join(given)}"
        )


def _load_deployments_file(standalone: StandalonePolicy, path: str) -> None:
    """Apply the deployments file at start-up; raises StartupError naming the field."""
    try:
        # Seen before it is read: a rewrite while it is read is then reloaded.
        standalone.deployments_mtime = os.stat(path).st_mtime_ns
        specs = load_deployments_file(path)
    except (OSError, ValueError) as exc:
        raise StartupError(f"invalid deployments file {path}: {exc}") from None
    if not specs:
        log.warning("the deployments file %s lists no running deployment", path)
    standalone.router.state.set_deployments(specs)
    log.info(
        "routing to %d deployment(s) of %d model(s) from %s",
        len(specs),
        len(standalone.router.state.by_model),
        path,
    )


def benchmark_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The benchmark keys from the flags, else the environment; raises StartupError when one
    is the API key (every client would then force modes)."""
    given = args.benchmark_keys or [os.environ.get(BENCHMARK_KEY_ENV, "")]
    keys = tuple(key.strip() for text in given for key in text.split(",") if key.strip())
    if args.api_key and args.api_key in keys:
        raise StartupError(
            f"a benchmark key (--benchmark-key / {BENCHMARK_KEY_ENV}) must differ from the API "
            "key: every client holding it could force policy modes"
        )
    if args.mode_header not in MODE_HEADER_POLICIES:
        raise StartupError(
            f"{MODE_HEADER_ENV} must be one of {', '.join(MODE_HEADER_POLICIES)}; "
            f"got {args.mode_header!r}"
        )
    return keys


def metrics_token(args: argparse.Namespace, keys: tuple[str, ...]) -> str | None:
    """The /metrics token, or None; raises StartupError when it is one of the router's keys
    (a client holding that key could then read every tenant's usage)."""
    token: str | None = args.metrics_token or None
    if token is not None and (token == args.api_key or token in keys):
        raise StartupError(
            f"the metrics token (--metrics-token / {METRICS_TOKEN_ENV}) must differ from the "
            "API key and the benchmark keys: every client holding it could read every "
            "tenant's usage"
        )
    return token


async def compose(args: argparse.Namespace) -> tuple[Router, web.Application, PolicySource]:
    """The router the flags describe: its state, its app and its policy source, wired
    together. The one place the parts meet; raises StartupError."""
    keys = benchmark_keys(args)
    if not args.shared_limits_timeout > 0:
        raise StartupError(
            f"--shared-limits-timeout must be more than 0 seconds; got {args.shared_limits_timeout}"
        )
    config = ServerConfig(
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        benchmark_keys=keys,
        mode_header=args.mode_header,
        metrics_token=metrics_token(args, keys),
        shared_limits_url=args.shared_limits_url,
        shared_limits_timeout=args.shared_limits_timeout,
        timeouts=Timeouts(
            args.connect_timeout,
            args.first_byte_timeout,
            args.idle_timeout,
            args.eject_base_seconds,
        ),
    )
    if config.mode_header == MODE_HEADER_POLICIES[0]:
        log.info("X-Syshax-Mode: honoured for %d benchmark key(s)", len(config.benchmark_keys))
    else:
        log.info("X-Syshax-Mode: --mode-header %s", config.mode_header)
    try:
        router = Router(config)
    except ValueError as exc:  # redis-py's word on a malformed URL
        raise StartupError(f"--shared-limits-url / {SHARED_LIMITS_ENV}: {exc}") from None
    if router.shared_limits is not None:
        log.info(
            "tenants' limits shared through Redis (bound %.1f ms)",
            1000 * config.shared_limits_timeout,
        )
    try:
        endpoint = traces_endpoint(args.otlp_traces_endpoint)
    except TracingError as exc:
        raise StartupError(str(exc)) from None
    source = await _policy_source(router, args)
    if endpoint is not None:
        try:
            router.tracer = start_tracing(endpoint, router.metrics.registry)
        except (TracingError, ImportError) as exc:
            raise StartupError(f"tracing to {endpoint}: {exc}") from None
        log.info("tracing requests to %s", endpoint)
    return router, build_app(router), source


def background(router: Router, source: PolicySource) -> list[asyncio.Task[None]]:
    """What runs beside the listener: the policy source, the engine scrapes, the engines' KV
    event streams (where deployments name them) and, with shared limits, this router's
    heartbeat in their Redis."""

    def interval() -> float:
        return router.state.default_policy().knobs.metrics_interval_seconds

    tasks = [
        asyncio.create_task(source.run()),
        asyncio.create_task(scrape_forever(lambda: list(router.state.backends.values()), interval)),
    ]
    if router.shared_limits is not None:
        tasks.append(asyncio.create_task(router.shared_limits.run()))
    tasks.append(asyncio.create_task(router.state.kv_events.run(interval, router.state.serving)))
    return tasks


async def serve(args: argparse.Namespace) -> int:
    try:
        router, app, source = await compose(args)
    except StartupError as exc:
        log.error("%s", exc)
        return 2
    if router.shared_limits is not None:
        await router.shared_limits.start()
    runner = web.AppRunner(app, handler_cancellation=True, **router.tracer.install(app))
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024, reuse_port=args.reuse_port)
    await site.start()
    port = bound_port(site, args.port)
    log.info("router listening on http://%s:%s", args.host, port)
    source.attach(args.advertise_url or f"http://{args.host}:{port}")
    tasks = background(router, source)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, source.hangup)
    if args.ready_file:
        write_ready_file(Path(args.ready_file), port)

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await runner.cleanup()
    await router.state.close()
    router.tracer.close()
    if router.shared_limits is not None:
        await router.shared_limits.close()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.workers > 1:
        return _supervise(args)
    if args.workers < 1:
        log.error("--workers must be at least 1")
        return 2
    try:
        import uvloop
    except ImportError:  # uvloop is optional; the standard loop works, only slower
        return asyncio.run(serve(args))
    return int(uvloop.run(serve(args)))


def _supervise(args: argparse.Namespace) -> int:
    import sys

    if args.control_plane:
        log.error("--workers > 1 is for standalone mode; a managed router runs one process")
        return 2
    argv = sys.argv[1:]
    if not argv or argv[0] != "router":
        log.error("--workers needs to be started as 'syshax router ...'")
        return 2
    return supervise(argv, args.host, args.port, args.workers, args.ready_file)
