"""``syshax profile render NAME [--docker] [--node NODE]``: the engines a profile would start.

Prints the command lines the node's agent would run for the profile (process runtime), or the
two ``docker run`` lines, GPU engine first and then the CPU engine with ``--ipc
container:<gpu>`` (controlplane/deployments/render.py). ``syshax profile list`` names the
profiles. Uses the local control plane's database, as ``syshax config`` does.
"""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs.add_parser("list", help="the profiles and their engine kind")
    render = verbs.add_parser("render", help="print a profile's engine command lines")
    render.add_argument("name", help="profile name")
    render.add_argument(
        "--docker", action="store_true", help="print docker run lines (GPU first, then CPU)"
    )
    render.add_argument(
        "--node",
        help="node whose cards, address and free cores to use "
        "(default: the only node, if there is exactly one)",
    )


def _fail(message: str) -> int:
    print(f"syshax profile: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from syshax.commands._django import setup

    setup()
    from common.errors import FieldError
    from controlplane.deployments.models import DeploymentProfile
    from controlplane.deployments.render import render_profile
    from controlplane.inventory.models import Node

    if args.verb == "list":
        profiles = list(DeploymentProfile.objects.order_by("name"))
        if not profiles:
            print("no profiles yet (create one in the dashboard, the admin or the REST API)")
        for profile in profiles:
            print(f"{profile.name}  {profile.engine}  {profile.model}")
        return 0
    try:
        profile = DeploymentProfile.objects.get(name=args.name)
    except DeploymentProfile.DoesNotExist:
        names = ", ".join(DeploymentProfile.objects.order_by("name").values_list("name", flat=True))
        return _fail(f"no profile named {args.name!r} (profiles: {names or 'none'})")
    node = None
    if args.node:
        try:
            node = Node.objects.get(name=args.node)
        except Node.DoesNotExist:
            names = ", ".join(Node.objects.order_by("name").values_list("name", flat=True))
            return _fail(f"no node named {args.node!r} (nodes: {names or 'none'})")
    else:
        nodes = list(Node.objects.order_by("name")[:2])
        if len(nodes) == 1:
            node = nodes[0]
        elif nodes:
            return _fail("there is more than one node: choose one with --node NODE")
    try:
        rendered = render_profile(profile, node, docker=args.docker)
    except FieldError as exc:
        return _fail(f"cannot render {profile.name!r}: {exc}")
    sys.stdout.write(rendered.text)
    return 0
