"""The local configuration ``syshax init`` writes and ``syshax config`` / ``syshax run`` use.

One file, ``syshax.env`` in the directory ``syshax init`` ran in (or the one
``SYSHAX_ENV_FILE`` names), holds the control plane's settings and the settings of the router
``syshax run`` starts, as KEY=VALUE lines. Real environment variables win over the file, as
they do for the control plane. The scheduling policy itself lives in the control plane's
database (``syshax config KNOB VALUE`` records a revision); ``syshax config`` also exports it
to ``<var>/policy.json``, the file a standalone ``syshax run`` router watches, so a change
reaches a running router within a second.
"""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from common.files import write_text_atomic
from controlplane.deployments.choices import PdProtocol
from controlplane.settings.env import find_env_file, parse_env_file

PROJECT_DIR = Path(__file__).resolve().parents[2]
POLICY_FILE_NAME = "policy.json"


class LocalConfigError(ValueError):
    """A missing or invalid local setting; the message names the key and the file."""


def _url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s)://HOST:PORT URL, got {value!r}")
    try:
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError:
        raise ValueError(f"has a port outside 1-65535: {value!r}") from None
    return value.rstrip("/")


def _optional_url(value: str) -> str:
    return _url(value) if value else ""


def _port(value: str) -> str:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise ValueError(f"must be a port number 1-65535, got {value!r}")
    return str(int(value))


def _choice(*choices: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def _text(value: str) -> str:
    if any(c in value for c in "\r\n"):
        raise ValueError("must be a single line")
    return value.strip()


def _host(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"must be a host name or address, got {value!r}")
    return value


@dataclass(frozen=True)
class LocalKey:
    name: str  # what `syshax config NAME VALUE` takes
    var: str  # the variable in syshax.env
    default: str
    meaning: str
    check: Callable[[str], str]
    secret: bool = False


# sysHAX's example configuration: GPU service 7001, CPU service 7002, conductor 7010.
LOCAL_KEYS: tuple[LocalKey, ...] = (
    LocalKey("gpu_url", "SYSHAX_GPU_URL", "http://127.0.0.1:7001", "GPU/NPU engine", _url),
    LocalKey(
        "cpu_url",
        "SYSHAX_CPU_URL",
        "http://127.0.0.1:7002",
        "CPU engine (empty: GPU only)",
        _optional_url,
    ),
    LocalKey("router_host", "SYSHAX_ROUTER_HOST", "127.0.0.1", "address the router binds", _host),
    LocalKey("router_port", "SYSHAX_ROUTER_PORT", "7010", "port the router listens on", _port),
    LocalKey("model", "SYSHAX_MODEL", "", "served model name (empty: ask the GPU engine)", _text),
    LocalKey(
        "pd_protocol",
        "SYSHAX_PD_PROTOCOL",
        "vllm",
        "vllm: upstream vLLM + KV connector; syshax: sysHAX's patched engines",
        _choice(*PdProtocol.values),
    ),
    LocalKey(
        "control_plane_url",
        "SYSHAX_CONTROL_PLANE_URL",
        "",
        "with router_token set, `syshax run` is a managed router",
        _optional_url,
    ),
    LocalKey("router_token", "SYSHAX_ROUTER_TOKEN", "", "router token (sxr_...)", _text, True),
    LocalKey(
        "router_api_key",
        "SYSHAX_ROUTER_API_KEY",
        "",
        "clients must send 'Authorization: Bearer KEY'",
        _text,
        True,
    ),
)
LOCAL_KEYS_BY_NAME = {key.name: key for key in LOCAL_KEYS}


def env_file() -> Path:
    """The file the control plane and these commands read (see ``find_env_file``)."""
    return find_env_file(PROJECT_DIR).resolve()


def set_in_file(path: Path, var: str, value: str) -> None:
    """Set ``var`` in the env file, replacing its line (or its commented example) in place."""
    lines = path.read_text().splitlines()
    wanted = f"{var}={value}"
    for i, line in enumerate(lines):
        bare = line.strip().lstrip("#").strip()
        if bare.partition("=")[0].strip() == var and "=" in bare:
            lines[i] = wanted
            break
    else:
        lines.append(wanted)
    write_text_atomic(path, "\n".join(lines) + "\n", 0o600)


def require_env_file(command: str) -> Path:
    path = env_file()
    if not path.is_file():
        raise LocalConfigError(f"no configuration at {path}: run 'syshax init' first ({command})")
    return path


def resolve(path: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every local key's checked value: the environment, else the file, else the default."""
    environ = os.environ if environ is None else environ
    in_file = parse_env_file(path) if path.is_file() else {}
    values: dict[str, str] = {}
    for key in LOCAL_KEYS:
        if environ.get(key.var):
            raw, where = environ[key.var], f"the environment variable {key.var}"
        elif key.var in in_file:
            raw, where = in_file[key.var], f"{key.var} in {path}"
        else:
            values[key.name] = key.default
            continue
        try:
            values[key.name] = key.check(raw)
        except ValueError as exc:
            raise LocalConfigError(f"{key.name} ({where}) {exc}") from None
    return values


def var_dir() -> Path:
    """The state directory, once Django's settings are loaded."""
    from django.conf import settings

    return Path(settings.VAR_DIR)


def export_policy(name: str = "default") -> Path:
    """Write the policy's routing payload to ``<var>/policy.json`` (Django must be set up)."""
    from controlplane.policy import services
    from controlplane.policy.api.serializers import routing_payload
    from controlplane.policy.models import SchedulingPolicy

    policy = (
        services.ensure_default_policy()
        if name == "default"
        else SchedulingPolicy.objects.get(name=name)
    )
    target = var_dir() / POLICY_FILE_NAME
    payload: dict[str, Any] = routing_payload(policy)
    write_text_atomic(target, json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return target
