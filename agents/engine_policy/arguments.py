"""Which engine arguments a spec may pass (docs/agent.md, "The engine policy").

vLLM has flags that load code the command line names: a class by its dotted name
(``--worker-extension-cls``), a Python file (``--tool-parser-plugin``), a module on the path
(``--kv-transfer-config``'s ``kv_connector_module_path``), or the model's own Python code
(``--trust-remote-code``). Those are refused, except the syshax KV connector's module. Flags
are read the way vLLM's parser reads them: ``_`` and ``-`` alike, ``--flag=value``, dotted
JSON keys (``--kv-transfer-config.kv_connector_module_path x``), and argparse's unambiguous
abbreviations (``--worker-ext``), which are refused for every flag checked here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from common.engine_spec import KV_CONNECTOR_MODULE

DENIED_OPTIONS = {
    "--trust-remote-code": "runs Python code that ships with the model",
    "--worker-cls": "loads a class the spec names",
    "--worker-extension-cls": "loads a class the spec names",
    "--scheduler-cls": "loads a class the spec names",
    "--logits-processors": "loads classes the spec names",
    "--logits-processor-pattern": "lets API clients load logits processors by name",
    "--middleware": "loads ASGI middleware the spec names",
    "--tool-parser-plugin": "runs a Python file the spec names",
    "--reasoning-parser-plugin": "runs a Python file the spec names",
    "--log-config-file": "a logging config file can call any importable function",
    "--config": "reads further engine arguments from a file the agent does not check",
    "--ready-file": "writes a file wherever the spec says",
}
EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")
COMPILE_BACKENDS = ("", "inductor", "eager")
SHORT_ALIASES = {"-O": "--compilation-config", "-cc": "--compilation-config"}
NUMBER = re.compile(r"-\d")


def _kv_transfer(config: Any) -> str | None:
    if not isinstance(config, Mapping):
        return "is not a JSON object"
    module = config.get("kv_connector_module_path")
    if module is not None and module != KV_CONNECTOR_MODULE:
        return (
            f"kv_connector_module_path {module!r} is not the syshax connector's module "
            f"({KV_CONNECTOR_MODULE})"
        )
    return None


def _ec_transfer(config: Any) -> str | None:
    if isinstance(config, Mapping) and config.get("ec_connector_module_path") is not None:
        return "ec_connector_module_path loads a module the spec names"
    return None


def _compilation(config: Any) -> str | None:
    if not isinstance(config, Mapping):
        return None  # an optimisation level, -O3
    if str(config.get("backend", "")) not in COMPILE_BACKENDS:
        return f"backend {config['backend']!r} loads a function the spec names"
    if "cache_dir" in config:
        return "cache_dir makes vLLM load compiled artifacts from where the spec says"
    return None


def _executor(value: Any) -> str | None:
    if value not in EXECUTOR_BACKENDS:
        return f"{value!r} is not one of {', '.join(EXECUTOR_BACKENDS)}"
    return None


CHECKED_OPTIONS: dict[str, Callable[[Any], str | None]] = {
    "--kv-transfer-config": _kv_transfer,
    "--ec-transfer-config": _ec_transfer,
    "--compilation-config": _compilation,
    "--distributed-executor-backend": _executor,
}
SENSITIVE = (*DENIED_OPTIONS, *CHECKED_OPTIONS)


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _nested(path: str, value: str) -> dict[str, Any]:
    """``a.b+`` and its value as the JSON vLLM builds from a dotted flag: {"a": {"b": ...}}."""
    keys = [k.removesuffix("+") for k in path.split(".")]
    nested: Any = _parse(value)
    for key in reversed(keys):
        nested = {key: nested}
    return dict(nested)


def _loader_keys(value: Any) -> Iterable[str]:
    """Keys anywhere in a JSON value that name code to load (``*_module_path``, ``*_cls``);
    the syshax KV connector's module is the one allowed."""
    if isinstance(value, Mapping):
        for key, inner in value.items():
            name = str(key)
            if name.endswith("_cls") or (
                name.endswith("module_path")
                and not (name == "kv_connector_module_path" and inner == KV_CONNECTOR_MODULE)
            ):
                yield name
            yield from _loader_keys(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _loader_keys(inner)


def _option(token: str) -> tuple[str, str, str | None]:
    """``--a_b.c=v`` -> ("--a-b", "c", "v"): the flag as vLLM normalises it, its dotted path
    and its inline value."""
    if token.startswith("-O") and token[2:3] not in ("", "."):  # -O3, -O{...}: value attached
        return SHORT_ALIASES["-O"], "", token[2:].removeprefix("=")
    head, eq, inline = token.partition("=")
    base, _, path = head.partition(".")
    if base.startswith("--"):
        base = "--" + base[2:].replace("_", "-")
    return SHORT_ALIASES.get(base, base), path, inline if eq else None


def args_refusal(args: Sequence[str], allowed: Iterable[str] = ()) -> str | None:
    """Why these engine arguments are refused, or None. ``allowed`` are the agent's
    ``--allow-engine-arg`` flags, which lift every rule for that flag."""
    lifted = {_option(flag)[0] for flag in allowed}
    for i, token in enumerate(args):
        if not token.startswith("-") or token in ("-", "--") or NUMBER.match(token):
            if token.lstrip().startswith(("{", "[")):
                loader = next(iter(_loader_keys(_parse(token))), None)
                if loader is not None and not _lifted_value(args, i, lifted):
                    return f"a JSON argument sets {loader}, which loads code the spec names"
            continue
        option, path, inline = _option(token)
        if option in lifted:
            continue
        following = args[i + 1] if i + 1 < len(args) else ""
        value_text = following if inline is None else inline
        if option in DENIED_OPTIONS:
            return f"{option} {DENIED_OPTIONS[option]} (widen with --allow-engine-arg {option[2:]})"
        if option.startswith("--") and option not in SENSITIVE:
            prefixed = [s for s in SENSITIVE if s.startswith(option)]
            if prefixed:
                return f"{token} abbreviates {prefixed[0]}; spell checked flags in full"
        value = _nested(path, value_text) if path else _parse(value_text)
        if path:
            loader = next(iter(_loader_keys(value)), None)
            if loader is not None:
                return f"{token} sets {loader}, which loads code the spec names"
        if option in CHECKED_OPTIONS:
            reason = CHECKED_OPTIONS[option](value)
            if reason is not None:
                return f"{option} {reason}"
        if inline is not None:
            loader = next(iter(_loader_keys(value)), None)
            if loader is not None:
                return f"{option} sets {loader}, which loads code the spec names"
    return None


def _lifted_value(args: Sequence[str], index: int, lifted: set[str]) -> bool:
    """Whether the value at ``index`` belongs to a flag the agent lifted the rules of."""
    return index > 0 and args[index - 1].startswith("-") and _option(args[index - 1])[0] in lifted
