"""``syshax config [KEY VALUE]``: show the live policy, or change one knob as a new revision.

Mirrors the source documents' ``cli.py config auto_pd_offload true``. With ``--url`` and
``--token`` (or SYSHAX_API_URL/SYSHAX_TOKEN) it goes through the REST API; otherwise it uses
the local control plane's database directly and exports the policy to the file a
``syshax run`` router watches. The keys of ``syshax run`` itself (``gpu_url``, ``cpu_url``,
``router_port``, ...) are set in the local ``syshax.env`` (syshax/commands/localconfig.py).
"""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from typing import Any

from common.policy_schema import KNOBS, PolicyError, coerce_value
from syshax.commands.localconfig import (
    LOCAL_KEYS,
    LOCAL_KEYS_BY_NAME,
    LocalConfigError,
    env_file,
    require_env_file,
    resolve,
    set_in_file,
)

# The documents' CLI names, mapped to the knobs they set.
ALIASES = {"auto_pd_offload": "enable_auto_pd_offload"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "key", nargs="?", help="knob name, e.g. auto_pd_offload, cpu_max_batch_size"
    )
    parser.add_argument("value", nargs="?", help="new value")
    parser.add_argument("--policy", default="default", help="policy name (default: default)")
    parser.add_argument("--reason", default="", help="why (recorded in the revision)")
    parser.add_argument("--json", action="store_true", help="print the policy as JSON")
    parser.add_argument(
        "--url",
        default=os.environ.get("SYSHAX_API_URL", ""),
        help="control plane URL; empty: use the local database",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("SYSHAX_TOKEN", ""),
        help="API token of a user (DRF token)",
    )


def _print_policy(policy: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(policy, indent=2, sort_keys=True))
        return
    print(f"policy {policy['name']} version {policy['version']}")
    width = max(len(k.name) for k in KNOBS)
    for knob in KNOBS:
        value = policy["knobs"][knob.name]
        shown = str(value).lower() if isinstance(value, bool) else value
        print(f"  {knob.name.ljust(width)}  {shown!s:<12} {knob.meaning}")


def run(args: argparse.Namespace) -> int:
    if args.key is not None and args.value is None:
        print(
            "syshax config: give both KEY and VALUE, or neither to show the policy", file=sys.stderr
        )
        return 2
    if args.key in LOCAL_KEYS_BY_NAME:
        return _set_local(args.key, args.value)
    key = ALIASES.get(args.key, args.key) if args.key else None
    try:
        value = coerce_value(key, args.value) if key else None
    except PolicyError as exc:
        print(f"syshax config: {exc}", file=sys.stderr)
        return 2
    reason = args.reason or (f"syshax config {args.key} {args.value}" if key else "")
    if args.url:
        return _remote(args, key, value, reason)
    return _local(args, key, value, reason)


def _set_local(name: str, value: str) -> int:
    key = LOCAL_KEYS_BY_NAME[name]
    try:
        path = require_env_file(f"syshax config {name}")
        checked = key.check(value)
    except LocalConfigError as exc:
        print(f"syshax config: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"syshax config: {name} {exc}", file=sys.stderr)
        return 2
    set_in_file(path, key.var, checked)
    shown = "(hidden)" if key.secret and checked else repr(checked)
    print(f"{name} = {shown} (written to {path}; takes effect on the next 'syshax run')")
    if os.environ.get(key.var) and os.environ[key.var] != checked:
        print(f"note: the environment variable {key.var} is set and wins over the file")
    return 0


def _print_local() -> None:
    path = env_file()
    if not path.is_file():
        print(f"\nno local configuration at {path} (syshax init writes one)")
        return
    try:
        values = resolve(path)
    except LocalConfigError as exc:
        print(f"\nsyshax run settings: {exc}")
        return
    print(f"\nsyshax run settings ({path})")
    width = max(len(k.name) for k in LOCAL_KEYS)
    for key in LOCAL_KEYS:
        value = values[key.name]
        shown = "(set)" if key.secret and value else (value or "-")
        print(f"  {key.name.ljust(width)}  {shown:<24} {key.meaning}")


def _local(args: argparse.Namespace, key: str | None, value: Any, reason: str) -> int:
    from syshax.commands._django import setup

    setup()
    from controlplane.policy import services
    from controlplane.policy.api.serializers import routing_payload
    from controlplane.policy.models import SchedulingPolicy
    from syshax.commands.localconfig import export_policy

    if args.policy == "default":
        services.ensure_default_policy()
    try:
        policy = SchedulingPolicy.objects.get(name=args.policy)
    except SchedulingPolicy.DoesNotExist:
        print(f"syshax config: no policy named {args.policy!r}", file=sys.stderr)
        return 2
    if key is not None and policy.knobs().get(key, object()) == value:
        # sysHAX's documented sequence sets knobs to the values they already have: not an error.
        print(f"{key} is already {value} (policy {policy.name} stays at version {policy.version})")
        return 0
    if key is not None:
        try:
            revision = services.update_policy(
                policy, changes={key: value}, acting_user=f"cli:{getpass.getuser()}", reason=reason
            )
        except PolicyError as exc:
            print(f"syshax config: {exc}", file=sys.stderr)
            return 2
        print(f"{key} = {value} (policy {policy.name} is now version {revision.version})")
        if policy.name == "default":
            export_policy()  # a running `syshax run` router picks it up within a second
        return 0
    _print_policy(routing_payload(policy), args.json)
    if not args.json:
        _print_local()
    return 0


def _remote(args: argparse.Namespace, key: str | None, value: Any, reason: str) -> int:
    import httpx

    base = args.url.rstrip("/")
    headers = {"Authorization": f"Token {args.token}"} if args.token else {}
    url = f"{base}/api/v1/policies/{args.policy}/"
    try:
        if key is not None:
            response = httpx.patch(
                url, json={key: value, "reason": reason}, headers=headers, timeout=10
            )
        else:
            response = httpx.get(
                f"{base}/api/v1/routing/policies/{args.policy}", headers=headers, timeout=10
            )
    except httpx.HTTPError as exc:
        print(f"syshax config: cannot reach {base}: {exc}", file=sys.stderr)
        return 1
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        print(f"syshax config: {response.status_code}: {message}", file=sys.stderr)
        return 1
    body = response.json()
    if key is not None:
        print(f"{key} = {value} (policy {body['name']} is now version {body['version']})")
    else:
        _print_policy(body, args.json)
    return 0
