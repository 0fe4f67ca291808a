"""What environment an engine gets (docs/agent.md, "The engine policy").

An engine never inherits the agent's environment: it gets a few of the agent's variables
(:data:`BASE_NAMES`, plus the operator's ``--pass-env`` names) and the spec's own variables
that pass :func:`env_refusal`. So the agent's token and every other ``SYSHAX_*`` setting stay
with the agent, and a profile cannot make the engine's dynamic loader or interpreter load code
of its choosing (``LD_PRELOAD``, ``PYTHONSTARTUP``, a ``PYTHONPATH`` elsewhere).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

# The agent's own variables every engine gets: where programs are, the home directory its
# caches live under, the locale and time zone, the temporary directory, the user.
BASE_NAMES = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "USER", "LOGNAME")

# Variables a spec may set, by exact name.
ALLOWED_NAMES = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA_LAUNCH_BLOCKING",
        "CUDA_MODULE_LOADING",
        "ASCEND_RT_VISIBLE_DEVICES",
        "CUSTOM_CPU_AFFINITY",  # sysHAX's patched V0 image reads its thread binding here
        "SYSHAX_QUANTIZE",  # the simulator's CPU engine (controlplane/deployments/specs.py)
        "TOKENIZERS_PARALLELISM",
        "TRANSFORMERS_OFFLINE",
        "PYTHONPATH",  # only the KV connector's directory: see python_path_refusal
        "PYTHONUNBUFFERED",
        "PYTHONHASHSEED",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONFAULTHANDLER",
        "LANG",
        "LC_ALL",
        "TZ",
        # An engine's tracing (docs/tracing.md): its exporter's protocol, its name and sampling.
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
    }
)
# Families of settings a spec may set: vLLM's own, Hugging Face's, and the OpenMP runtimes'
# and NCCL's tuning knobs.
ALLOWED_PREFIXES = ("VLLM_", "HF_", "OMP_", "KMP_", "GOMP_", "NCCL_")
# Members of those families that load code or configuration the agent cannot check.
DENIED_NAMES = {
    "VLLM_LOGGING_CONFIG_PATH": "a logging config file can call any importable function",
    "VLLM_CACHE_ROOT": "vLLM loads compiled (pickled) artifacts from its cache",
    "VLLM_XLA_CACHE_PATH": "vLLM loads compiled artifacts from its cache",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "it lets vLLM's processes exchange pickles",
    "VLLM_SERVER_DEV_MODE": "it opens vLLM's development endpoints (collective_rpc, reset)",
    "HF_MODULES_CACHE": "Python imports model code from that directory",
}
# Name parts that mean "a library or plugin to load": NCCL_NET_PLUGIN, VLLM_NCCL_SO_PATH,
# OMP_TOOL_LIBRARIES. VLLM_PLUGINS only narrows which installed plugins load.
DENIED_PARTS = ("PLUGIN", "LIBRAR", "_SO_PATH", "OMP_TOOL")
NARROWING = frozenset({"VLLM_PLUGINS"})
MAX_VALUE_CHARS = 8192
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def engine_base_env(environ: Mapping[str, str], pass_names: Iterable[str] = ()) -> dict[str, str]:
    """The agent's variables an engine starts from: :data:`BASE_NAMES` and ``pass_names``."""
    names = (*BASE_NAMES, *pass_names)
    return {name: environ[name] for name in names if name in environ}


def env_lifted(name: str, extra: Iterable[str]) -> bool:
    """Whether an ``--allow-env`` entry (``NAME`` or ``PREFIX*``) names ``name``."""
    return any(name == e or (e.endswith("*") and name.startswith(e[:-1])) for e in extra)


def env_refusal(name: str, value: str, extra: Iterable[str] = ()) -> str | None:
    """Why the spec may not set ``name`` to ``value``, or None. ``extra`` are the agent's
    ``--allow-env`` names (``NAME`` or ``PREFIX*``), which lift the name rules."""
    if len(value) > MAX_VALUE_CHARS or CONTROL.search(value):
        return f"the value of {name} has control characters or is over {MAX_VALUE_CHARS} chars"
    if env_lifted(name, extra):
        return None
    if name in DENIED_NAMES:
        return f"{name} is refused: {DENIED_NAMES[name]}"
    if name in ALLOWED_NAMES:
        return None
    if name.startswith(ALLOWED_PREFIXES):
        if name not in NARROWING and any(part in name for part in DENIED_PARTS):
            return f"{name} is refused: it names a library or plugin for the engine to load"
        return None
    families = ", ".join(f"{p}*" for p in ALLOWED_PREFIXES)
    return (
        f"{name} is not an engine setting this agent passes (allowed: {families}, CUDA and "
        "thread settings, PYTHONPATH to the KV connector; widen with --allow-env)"
    )


def python_path_refusal(value: str, connector_dir: str) -> str | None:
    """A spec's ``PYTHONPATH`` may name only the KV connector's directory (which the runtime
    puts there anyway for a ``kv_connector`` spec), or be empty."""
    if not value:
        return None
    others = [entry for entry in value.split(os.pathsep) if entry != connector_dir]
    if others:
        return (
            f"PYTHONPATH may name only the KV connector directory ({connector_dir}), "
            f"not {others[0]!r}"
        )
    return None
