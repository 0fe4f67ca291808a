"""``syshax sim``: run one simulated vLLM engine.

Accepts the vLLM flags the node agents pass to a real engine, so an agent can launch either.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from common.presets import DEVICES, MODELS
from common.tracing import TracingError, traces_endpoint

log = logging.getLogger("sim")


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _flag(parser: argparse._ActionsContainer, name: str, **kw: Any) -> None:
    """A flag under its dashed name and vLLM's underscore spelling (--gpu_memory_utilization)."""
    names = [name]
    if "-" in name[2:]:
        names.append("--" + name[2:].replace("-", "_"))
    parser.add_argument(*names, **kw)


class _V0Flag(argparse.Action):
    """A flag of sysHAX's patched V0 engine: stored with the spelling it was given, so that
    without ``--syshax-compat`` it is refused the way vLLM 0.32 refuses it (see ``run``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        given = [*getattr(namespace, "v0_flags_given", []), f"{option_string} {values}"]
        namespace.v0_flags_given = given


def _model_name(text: str) -> str:
    """A model preset, also found by its Hugging Face id (what an agent passes to vLLM)."""
    for preset in MODELS.values():
        if text.lower() in (preset.name, preset.hf_id.lower()):
            return preset.name
    raise argparse.ArgumentTypeError(
        f"unknown model {text!r}; choose one of {sorted(MODELS)} (or their Hugging Face ids)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", required=True, choices=sorted(DEVICES), help="hardware preset")
    parser.add_argument(
        "--model", required=True, type=_model_name, help=f"model preset: {', '.join(MODELS)}"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    _flag(parser, "--ready-file", type=Path, help="write the bound port here once listening")
    parser.add_argument("--speed", type=_positive_float, default=1.0, help="time compression")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics", choices=["current", "legacy", "both"], default="both")
    _flag(parser, "--served-model-name", help="default: the model preset name")
    _flag(parser, "--engine-id", help="default: <device>-<pid>; the metrics 'engine' label")
    _flag(parser, "--max-num-seqs", type=int, default=256)
    _flag(parser, "--max-model-len", type=int)
    _flag(parser, "--max-num-batched-tokens", type=int)
    _flag(parser, "--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--tensor-parallel-size", "--tensor_parallel_size", "-tp", type=int, default=1
    )
    _flag(
        parser,
        "--syshax-compat",
        action="store_true",
        help="sysHAX-compatible mode: the patched V0 engine's flags and request fields "
        "(without it the flags follow vLLM 0.32's V1 engine)",
    )
    _flag(
        parser,
        "--preemption-mode",
        action=_V0Flag,
        choices=["swap", "recompute"],
        help="with --syshax-compat only (vLLM V1 has no such flag and always recomputes)",
    )
    _flag(
        parser,
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="fcfs, or priority: the waiting queue in (priority, arrival) order and the "
        "lowest priority preempted first; a request's non-zero priority is a 400 under fcfs",
    )
    _flag(parser, "--swap-space", type=float, default=4.0, help="GiB of KV swap space")
    _flag(
        parser,
        "--kv-cache-space",
        type=float,
        help="GiB of KV cache for CPU engines (default: env VLLM_CPU_KVCACHE_SPACE, else 4)",
    )
    _flag(
        parser,
        "--shm-dir",
        type=Path,
        help="where KV segments live (default /dev/shm; the temp dir where there is none)",
    )
    _flag(parser, "--kv-lease-seconds", type=_positive_float, default=30.0)
    _flag(parser, "--block-size", type=int, default=16)
    _flag(
        parser,
        "--cpu-bind",
        help="CPU engines: the cores it may use, e.g. 0-39,40-79 (default: env "
        "VLLM_CPU_OMP_THREADS_BIND, else all cores of the preset)",
    )
    _flag(parser, "--log-level", default="INFO")
    _flag(
        parser,
        "--kv-transfer-config",
        help="vLLM's KV connector JSON: SyshaxShmConnector only; its kv_connector_extra_config "
        "engine_id, peer_engine_id, shm_dir and lease_seconds win over --engine-id, --shm-dir "
        "and --kv-lease-seconds",
    )
    _flag(
        parser,
        "--disable-log-stats",
        action="store_true",
        help="no vllm:* metrics on /metrics, as vLLM serves none with this flag",
    )
    _flag(
        parser,
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens, as vLLM does with this flag",
    )
    _flag(
        parser,
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's automatic prefix caching (default: on, as in vLLM's V1 engine; off with "
        "--syshax-compat, as in the V0 engine)",
    )
    _flag(
        parser,
        "--kv-events-config",
        help='vLLM\'s KV events JSON, e.g. {"enable_kv_cache_events": true, "publisher": '
        '"zmq", "endpoint": "tcp://*:5557"}: the prefix cache\'s BlockStored and '
        "BlockRemoved events on a ZMQ PUB socket, as vLLM publishes them",
    )
    _flag(
        parser,
        "--otlp-traces-endpoint",
        help="emit vLLM's llm_request span per request to this OTLP/HTTP collector URL, e.g. "
        "http://127.0.0.1:4318/v1/traces, as a child of the request's traceparent",
    )
    ignored = parser.add_argument_group("accepted for vLLM compatibility and ignored")
    for name in ("--dtype", "--quantization", "--uvicorn-log-level"):
        _flag(ignored, name)
    for name in ("--enforce-eager", "--trust-remote-code", "--disable-log-requests",
                 "--enable-chunked-prefill"):  # fmt: skip
        _flag(ignored, name, action="store_true")


def _default_shm_dir() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir():
        return shm
    # macOS and some CI sandboxes have no /dev/shm: a private temp dir still lets two
    # engines given the same --shm-dir hand KV over.
    fallback = Path(tempfile.gettempdir()) / "syshax-shm"
    fallback.mkdir(exist_ok=True)
    log.warning("no /dev/shm here; KV segments go to %s", fallback)
    return fallback


def _kv_space(args: argparse.Namespace) -> float:
    if args.kv_cache_space is not None:
        return float(args.kv_cache_space)
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not env:
        return 4.0
    try:
        return float(env)
    except ValueError:
        raise SystemExit(
            f"syshax sim: VLLM_CPU_KVCACHE_SPACE={env!r} is not a number of GiB"
        ) from None


def run(args: argparse.Namespace) -> int:
    refused = getattr(args, "v0_flags_given", [])
    if refused and not args.syshax_compat:
        # What vLLM 0.32's argument parser answers, and argparse's exit code.
        print(f"syshax sim: error: unrecognized arguments: {' '.join(refused)}", file=sys.stderr)
        print("syshax sim: (sysHAX's V0 flags need --syshax-compat)", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # lazy: --help and the flag checks above stay instant (the engine loads numpy, aiohttp)
    from common.kv_events import parse_kv_events_config
    from common.presets import device_preset, model_preset
    from sim.connector import parse_kv_transfer_config
    from sim.engine import EngineConfig
    from sim.perfmodel import bind_cpu
    from sim.server import ServerSettings, serve

    preset = device_preset(args.device)
    bind = args.cpu_bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    try:
        device = bind_cpu(preset, bind)
    except ValueError as exc:
        print(f"syshax sim: CPU binding {bind!r}: {exc}", file=sys.stderr)
        return 2
    if device is not preset:
        log.info("bound to %d cores on %d NUMA node(s)", device.cores, device.numa_nodes)
    if args.tensor_parallel_size < 1 or args.max_num_seqs < 1:
        print("syshax sim: --tensor-parallel-size and --max-num-seqs must be >= 1", file=sys.stderr)
        return 2
    connector = None
    if args.kv_transfer_config is not None:
        try:
            connector = parse_kv_transfer_config(args.kv_transfer_config)
        except ValueError as exc:
            print(f"syshax sim: --kv-transfer-config: {exc}", file=sys.stderr)
            return 2
        # The connector's own settings win: they are what a real engine would use.
        args.engine_id = connector.engine_id or args.engine_id
        if connector.shm_dir is not None:
            connector.shm_dir.mkdir(parents=True, exist_ok=True)  # as the connector does
            args.shm_dir = connector.shm_dir
        args.kv_lease_seconds = connector.lease_seconds or args.kv_lease_seconds
    kv_events = None
    if args.kv_events_config is not None:
        try:
            kv_events = parse_kv_events_config(args.kv_events_config)
        except ValueError as exc:
            print(f"syshax sim: --kv-events-config: {exc}", file=sys.stderr)
            return 2
    try:
        endpoint = traces_endpoint(args.otlp_traces_endpoint) if args.otlp_traces_endpoint else None
    except TracingError as exc:
        print(f"syshax sim: {exc}", file=sys.stderr)
        return 2
    if args.shm_dir is None:
        args.shm_dir = _default_shm_dir()
    if not args.shm_dir.is_dir():
        print(f"syshax sim: --shm-dir {args.shm_dir} is not a directory", file=sys.stderr)
        return 2
    config = EngineConfig(
        device=device,
        model=model_preset(args.model),
        served_model_name=args.served_model_name or args.model,
        engine_id=args.engine_id or f"{args.device}-{os.getpid()}",
        speed=args.speed,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_space_gb=_kv_space(args),
        swap_space_gb=args.swap_space,
        preemption_mode=args.preemption_mode or "recompute",
        scheduling_policy=args.scheduling_policy,
        syshax_compat=args.syshax_compat,
        block_size=args.block_size,
        enable_prefix_caching=(
            not args.syshax_compat
            if args.enable_prefix_caching is None
            else args.enable_prefix_caching
        ),
        kv_events=kv_events,
    )
    if kv_events is not None and kv_events.publishes and not config.enable_prefix_caching:
        log.warning("--kv-events-config: no events without prefix caching")
    settings = ServerSettings(
        host=args.host,
        metrics_mode=args.metrics,
        shm_dir=args.shm_dir,
        kv_lease_seconds=args.kv_lease_seconds,
        kv_connector=connector,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        log_stats=not args.disable_log_stats,
        otlp_traces_endpoint=endpoint,
    )
    try:
        asyncio.run(serve(config, settings, args.port, args.ready_file))
    except ValueError as exc:
        print(f"syshax sim: {exc}", file=sys.stderr)
        return 2
    return 0
