"""``syshax agent``: run the node agent (docs/agent.md)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from pathlib import Path

from agents.discovery import SIMULATED_PRESETS, parse_simulated
from agents.main import Agent, AgentConfig
from common.tracing import TracingError, traces_endpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control-plane",
        default=os.environ.get("SYSHAX_CONTROL_PLANE"),
        help="control plane base URL, e.g. http://10.0.0.1:8000 (env SYSHAX_CONTROL_PLANE)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("SYSHAX_AGENT_TOKEN"),
        help="the node's sxa_ token (env SYSHAX_AGENT_TOKEN)",
    )
    parser.add_argument("--name", help="node name; must match the token's node if given")
    parser.add_argument(
        "--runtime", choices=["docker", "kubernetes", "process"], help="default process"
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        help="seconds between heartbeats (default: the control plane's)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="where engine records, command results and logs live "
        "(default var/agent/<name or hostname>)",
    )
    policy = parser.add_argument_group(
        "engine policy",
        "by default engines are only vLLM's OpenAI server and the simulator, run by this "
        "agent's Python or an --engine-python, from the vLLM and syshax images, with engine "
        "settings only (docs/agent.md); every widening below is logged as a warning at start",
    )
    policy.add_argument(
        "--engine-python",
        action="append",
        default=[],
        metavar="PATH",
        help="another interpreter that may run vLLM's or the simulator's entry points "
        "(repeatable), e.g. /opt/vllm/bin/python",
    )
    policy.add_argument(
        "--allow-image",
        action="append",
        default=[],
        metavar="PATTERN",
        help="also run engine images matching this shell pattern (repeatable; docker "
        "runtime), e.g. 'registry.local/vllm/*'",
    )
    policy.add_argument(
        "--allow-command",
        action="append",
        default=[],
        metavar="PATH",
        help="also run this program, with any arguments (repeatable): an absolute path, "
        "each segment may be a shell pattern, e.g. '/opt/vllm-*/bin/vllm-launcher'",
    )
    policy.add_argument(
        "--allow-env",
        action="append",
        default=[],
        metavar="NAME",
        help="let specs set this environment variable, or NAME* for a family (repeatable)",
    )
    policy.add_argument(
        "--allow-engine-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="let specs pass this refused engine flag, e.g. trust-remote-code (repeatable)",
    )
    policy.add_argument(
        "--allow-workdir",
        action="append",
        default=[],
        metavar="DIR",
        help="let specs run engines in this directory or below (repeatable; default only "
        "the state dir)",
    )
    policy.add_argument(
        "--allow-any-engine",
        action="store_true",
        default=None,
        help="run whatever a spec asks for (mounts are still only --mount's): for test rigs",
    )
    policy.add_argument(
        "--pass-env",
        action="append",
        default=[],
        metavar="NAME",
        help="hand engines this variable of the agent's own environment, e.g. "
        "LD_LIBRARY_PATH (repeatable; never SYSHAX_*)",
    )
    parser.add_argument(
        "--simulate-accelerator",
        action="append",
        default=[],
        metavar="PRESET",
        help="declare a simulated card (repeatable; PRESET*N for N cards): "
        + ", ".join(sorted(SIMULATED_PRESETS)),
    )
    parser.add_argument("--docker-url", help="Docker API URL (default DOCKER_HOST)")
    parser.add_argument(
        "--mount",
        action="append",
        default=[],
        metavar="SRC[:DST][:ro|rw]",
        help="bind mount for every engine container (docker runtime; repeatable), e.g. a "
        "model cache; read-only unless :rw, and a spec cannot make it writable",
    )
    kube = parser.add_argument_group(
        "kubernetes runtime", "engine pairs as pods on this agent's node (docs/kubernetes.md)"
    )
    kube.add_argument(
        "--kubernetes-namespace",
        default=os.environ.get("SYSHAX_KUBERNETES_NAMESPACE"),
        help="the namespace of the engine pods (env SYSHAX_KUBERNETES_NAMESPACE; default "
        "syshax-engines)",
    )
    kube.add_argument(
        "--kubernetes-node",
        default=os.environ.get("SYSHAX_KUBERNETES_NODE"),
        help="the Kubernetes node this agent runs on (env SYSHAX_KUBERNETES_NODE)",
    )
    kube.add_argument(
        "--kubernetes-model-claim",
        default=os.environ.get("SYSHAX_KUBERNETES_MODEL_CLAIM"),
        metavar="CLAIM",
        help="a PersistentVolumeClaim holding the models, mounted read-only at "
        "--kubernetes-model-root (default: each model's directory on the node, as a hostPath)",
    )
    kube.add_argument("--kubernetes-model-root", help="where the claim is mounted (/models)")
    kube.add_argument(
        "--kubernetes-connector-image",
        default=os.environ.get("SYSHAX_KUBERNETES_CONNECTOR_IMAGE"),
        help="the project image the KV connector is copied from (default: this version's)",
    )
    parser.add_argument("--sys-root", help="the host's /sys, for the inventory (default /sys)")
    parser.add_argument("--proc-root", help="the host's /proc, for the inventory (default /proc)")
    parser.add_argument("--address", help="address reported in the inventory")
    parser.add_argument(
        "--config",
        type=Path,
        help="JSON file with any of these options (underscored keys); command-line flags win",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        help="an OTLP/HTTP collector's URL: each command's span goes there, in the trace of "
        "the work that issued it (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; docs/tracing.md)",
    )
    parser.add_argument("--log-level", default="INFO")


def build_config(args: argparse.Namespace) -> AgentConfig:
    file_opts: dict[str, object] = {}
    if args.config:
        file_opts = json.loads(args.config.read_text())

    def pick(name: str, default: object = None) -> object:
        value = getattr(args, name, None)
        return value if value not in (None, []) else file_opts.get(name, default)

    control_plane, token = pick("control_plane"), pick("token")
    if not control_plane or not token:
        raise SystemExit("syshax agent: --control-plane and --token are required")
    name = pick("name")
    state_dir = pick("state_dir") or Path("var/agent") / str(name or socket.gethostname())
    simulate = pick("simulate_accelerator", [])
    assert isinstance(simulate, list)
    try:
        presets = parse_simulated(str(s) for s in simulate)
    except ValueError as exc:
        raise SystemExit(f"syshax agent: {exc}") from None
    try:
        traces = traces_endpoint(_optional(pick("otlp_traces_endpoint")))
    except TracingError as exc:
        raise SystemExit(f"syshax agent: {exc}") from None
    interval = pick("heartbeat_interval")
    mounts = pick("mount", [])
    assert isinstance(mounts, list)
    return AgentConfig(
        control_plane=str(control_plane),
        token=str(token),
        state_dir=Path(str(state_dir)),
        name=str(name) if name else None,
        runtime=str(pick("runtime", "process")),
        heartbeat_interval=float(str(interval)) if interval else None,
        engine_pythons=[str(p) for p in _as_list(pick("engine_python", []))],
        allow_images=[str(p) for p in _as_list(pick("allow_image", []))],
        allow_commands=[str(p) for p in _as_list(pick("allow_command", []))],
        allow_env=[str(p) for p in _as_list(pick("allow_env", []))],
        allow_engine_args=[_flag(str(p)) for p in _as_list(pick("allow_engine_arg", []))],
        allow_workdirs=[str(p) for p in _as_list(pick("allow_workdir", []))],
        allow_any_engine=pick("allow_any_engine", False) is True,
        pass_env=[str(p) for p in _as_list(pick("pass_env", []))],
        simulate=presets,
        docker_url=str(pick("docker_url")) if pick("docker_url") else None,
        address=str(pick("address")) if pick("address") else None,
        mounts=[str(m) for m in mounts],
        kubernetes_namespace=str(pick("kubernetes_namespace", "syshax-engines")),
        kubernetes_node=_optional(pick("kubernetes_node")),
        kubernetes_model_claim=_optional(pick("kubernetes_model_claim")),
        kubernetes_model_root=str(pick("kubernetes_model_root", "/models")),
        kubernetes_connector_image=_optional(pick("kubernetes_connector_image")),
        sys_root=str(pick("sys_root", "/sys")),
        proc_root=str(pick("proc_root", "/proc")),
        otlp_traces_endpoint=traces,
    )


def _optional(value: object) -> str | None:
    return str(value) if value else None


def _flag(name: str) -> str:
    """``trust-remote-code`` -> ``--trust-remote-code`` (a flag's dashes are optional)."""
    return name if name.startswith("-") else f"--{name}"


def _as_list(value: object) -> list[object]:
    if not isinstance(value, list):
        raise SystemExit(f"syshax agent: expected a list, got {value!r}")
    return value


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return Agent(build_config(args)).run()
