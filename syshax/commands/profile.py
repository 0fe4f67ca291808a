"""``syshax profile render NAME [--docker | --kubernetes] [--node NODE]``: the engines a
profile would start.

Prints the command lines the node's agent would run for the profile (process runtime), or the
two ``docker run`` lines, GPU engine first and then the CPU engine with ``--ipc
container:<gpu>`` (controlplane/deployments/render.py), or the pod the agent's Kubernetes
runtime would create, from the runtime's own builder (agents/runtimes/kubernetes_pod.py).
``syshax profile list`` names the profiles. Uses the local control plane's database, as
``syshax config`` does.
"""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs.add_parser("list", help="the profiles and their engine kind")
    render = verbs.add_parser("render", help="print a profile's engine command lines")
    render.add_argument("name", help="profile name")
    render.add_argument(
        "--docker", action="store_true", help="print docker run lines (GPU first, then CPU)"
    )
    render.add_argument(
        "--kubernetes",
        action="store_true",
        help="print the engine pod (YAML) the agent's kubernetes runtime would create",
    )
    render.add_argument(
        "--namespace",
        default="syshax-engines",
        help="the engines' namespace, for --kubernetes (default syshax-engines)",
    )
    render.add_argument(
        "--model-claim",
        metavar="CLAIM",
        help="for --kubernetes: the PersistentVolumeClaim holding the models, mounted at "
        "--model-root (default: the model's directory on the node, as a hostPath)",
    )
    render.add_argument(
        "--model-root", default="/models", help="where --model-claim is mounted (default /models)"
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
    from common.engine_spec import SpecError
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
    if args.docker and args.kubernetes:
        return _fail("choose one of --docker and --kubernetes")
    try:
        if args.kubernetes:
            text = kubernetes_pod_text(profile, node, args)
        else:
            text = render_profile(profile, node, docker=args.docker).text
    except (FieldError, SpecError) as exc:
        return _fail(f"cannot render {profile.name!r}: {exc}")
    sys.stdout.write(text)
    return 0


def kubernetes_pod_text(profile: Any, node: Any, args: argparse.Namespace) -> str:
    """The pod of ``profile`` on ``node`` as YAML: the specs the control plane sends
    (``profile_engine_spec``) through the builder the agent's Kubernetes runtime creates its
    pods with. As with --docker, the engines are named after the profile and the agent's
    labels and record are left out (an agent adopts the pods that carry them)."""
    import yaml

    from agents.runtimes.kubernetes_pod import PodEngine, PodOptions, engine_pod
    from controlplane.deployments.placement import placement_plan
    from controlplane.deployments.specs import profile_engine_spec

    plan = placement_plan(profile, node) if node is not None else {}
    names = (f"syshax-{profile.name}-gpu", f"syshax-{profile.name}-cpu")
    roles = ["gpu", "cpu"] if profile.enable_cpu_engine else ["gpu"]
    engines = [
        PodEngine(
            role=role,
            name=names[index],
            spec=profile_engine_spec(profile, role, node=node, plan=plan, names=names),
        )
        for index, role in enumerate(roles)
    ]
    options = PodOptions(
        namespace=args.namespace,
        node=node.name if node is not None else None,
        model_claim=args.model_claim,
        model_root=args.model_root,
        managed=False,
    )
    pod = engine_pod(engines, options)
    where = f"on node {node.name}" if node is not None else "(no node: no placement)"
    notes = [
        f"profile {profile.name} ({profile.engine}) {where}: the pod the kubernetes runtime "
        "creates",
        "kubectl apply -f - creates it; the node's agent does not adopt it (no agent labels)",
    ]
    if len(engines) == 2:
        notes.append(
            "the GPU engine is a native sidecar: the CPU engine starts once its probe passes"
        )
    head = "".join(f"# {note}\n" for note in notes)
    return head + yaml.safe_dump(pod, sort_keys=False, width=100)
