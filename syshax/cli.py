"""The ``syshax`` console script.

Each subcommand lives in its own module, imported only when that subcommand runs, so
``syshax router`` never loads Django and ``syshax sim`` starts in milliseconds. A subcommand
module provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "init": ("syshax.commands.init", "prepare this directory: syshax.env, database, policy"),
    "config": ("syshax.commands.config", "show or change a policy knob or a `run` setting"),
    "run": ("syshax.commands.run", "start the router on the engines syshax.env names"),
    "profile": ("syshax.commands.profile", "render a profile's engine commands or docker run"),
    "manage": ("syshax.commands.manage", "run a Django management command of the control plane"),
    "web": ("syshax.commands.web", "serve the control plane (dashboard, admin, REST API)"),
    "gateway": (
        "syshax.commands.gateway",
        "serve agents' and routers' hottest requests in front of `web`",
    ),
    "worker": ("syshax.commands.worker", "run a Celery worker of the control plane"),
    "beat": ("syshax.commands.beat", "run Celery beat with the database scheduler"),
    "sim": ("sim.cli", "run a simulated vLLM-compatible engine"),
    "agent": ("agents.cli", "run the node agent"),
    "router": ("router.cli", "run the OpenAI-compatible PD router"),
    "benchmark": ("loadgen.cli", "run a benchmark scenario"),
    "up": ("syshax.commands.up", "run the whole system locally on the embedded defaults"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: syshax COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'syshax COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] in {"-V", "--version"}:
        from common import __version__

        print(__version__)
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"syshax: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"syshax: command {name!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    parser = argparse.ArgumentParser(prog=f"syshax {name}", description=help_)
    module.add_arguments(parser)
    parsed = parser.parse_args(args[1:])
    try:
        return int(module.run(parsed) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("SYSHAX_DEBUG"):
            raise
        print(f"syshax {name}: {describe_failure(exc)}", file=sys.stderr)
        return 1


def describe_failure(exc: BaseException) -> str:
    """One line for an unexpected failure; a database that was never set up says what to run."""
    text = (str(exc).strip().splitlines() or [""])[0]
    kind = type(exc).__name__
    missing_table = "no such table" in text or ("relation" in text and "does not exist" in text)
    if kind in {"OperationalError", "ProgrammingError"} and missing_table:
        return f"the control plane's database is not set up ({text}): run 'syshax init' first"
    if kind == "OperationalError":
        return f"cannot use the control plane's database: {text}"
    return f"{kind}: {text} (set SYSHAX_DEBUG=1 to see the traceback)"


if __name__ == "__main__":
    raise SystemExit(main())
