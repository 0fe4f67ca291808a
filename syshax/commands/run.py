"""``syshax run``: start the router as sysHAX's ``cli.py run`` starts its conductor.

It reads what ``syshax init`` wrote and ``syshax config`` changed (syshax/commands/localconfig.py):

* standalone (the default): the engines at ``gpu_url`` and ``cpu_url`` (sysHAX's 7001 and 7002),
  the router on ``router_host:router_port`` (7010), the policy of the local database, exported
  to ``<var>/policy.json``. The router watches that file, so ``syshax config KNOB VALUE`` in
  another shell changes the running router within a second. No control plane process is needed.
* managed: with ``control_plane_url`` and ``router_token`` set, a managed router that takes its
  deployments and policy from that control plane. The token reaches the router through its
  environment, never its command line.
"""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import os
import shlex
import sys

from controlplane.settings.env import ImproperlyConfiguredEnv, load_env_file
from syshax.commands.localconfig import LocalConfigError, require_env_file, resolve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--print",
        dest="print_only",
        action="store_true",
        help="print the router command this would run, and exit",
    )
    parser.add_argument("--log-level", default="INFO")


def router_argv(values: dict[str, str], policy_file: str | None, state_dir: str) -> list[str]:
    """The ``syshax router`` arguments for the resolved local settings (no secrets in them)."""
    argv = ["--host", values["router_host"], "--port", values["router_port"]]
    if values["control_plane_url"]:
        return [*argv, "--control-plane", values["control_plane_url"], "--state-dir", state_dir]
    argv += ["--gpu-url", values["gpu_url"], "--pd-protocol", values["pd_protocol"]]
    if values["cpu_url"]:
        argv += ["--cpu-url", values["cpu_url"]]
    if values["model"]:
        argv += ["--model", values["model"]]
    if policy_file:
        argv += ["--policy", policy_file]
    return argv


def _fail(message: str) -> int:
    print(f"syshax run: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        path = require_env_file("syshax run")
        values = resolve(path)  # before the file is loaded, so an error says where the value was
        load_env_file(path)
    except (LocalConfigError, ImproperlyConfiguredEnv) as exc:
        return _fail(str(exc))
    managed = bool(values["control_plane_url"])
    if managed and not values["router_token"]:
        return _fail(
            f"control_plane_url is set in {path} but router_token is not: "
            "syshax config router_token sxr_... (or clear control_plane_url)"
        )
    os.environ["SYSHAX_ENV_FILE"] = str(path)  # Django below reads this same file
    from syshax.commands._django import setup

    setup()
    from syshax.commands.localconfig import export_policy, var_dir

    state_dir = str(var_dir() / "router")
    policy_file = None if managed else str(export_policy())
    argv = router_argv(values, policy_file, state_dir)
    if args.print_only:
        print(shlex.join(["syshax", "router", *argv]))
        return 0
    if values["router_token"]:
        os.environ["SYSHAX_ROUTER_TOKEN"] = values["router_token"]
    if values["router_api_key"]:
        os.environ["SYSHAX_ROUTER_API_KEY"] = values["router_api_key"]
    from router import cli as router_cli

    parser = argparse.ArgumentParser(prog="syshax router")
    router_cli.add_arguments(parser)
    router_args = parser.parse_args([*argv, "--log-level", args.log_level])
    mode = "managed by " + values["control_plane_url"] if managed else "standalone"
    print(f"syshax run: router {mode} on {values['router_host']}:{values['router_port']}")
    return router_cli.run(router_args)
