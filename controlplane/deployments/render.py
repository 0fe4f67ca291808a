"""What a profile would start on a node, as text an operator can copy: the agent's process
command lines, or the two ``docker run`` lines (GPU engine first, then the CPU engine in its IPC
namespace).

The text comes from the builders the agent itself uses: ``profile_engine_spec`` (the spec the
control plane sends), the docker runtime's ``container_kwargs`` (what the agent hands Docker)
and ``docker_run_argv`` (those arguments as a ``docker run`` line), so it cannot drift from
what a deployment really runs. Two things differ on purpose: the engines are named after the
profile (``syshax-<profile>-gpu``) rather than a deployment, and the agent's bookkeeping labels
are left out, because a node's agent adopts containers that carry them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from common.containers import container_kwargs, docker_run_argv
from common.engine_spec import EngineSpec, kv_connector_dir, prepend_python_path
from common.errors import FieldError
from controlplane.deployments.masking import HIDDEN, hide_env
from controlplane.deployments.models import DeploymentProfile
from controlplane.deployments.placement import PlacementError, placement_plan
from controlplane.deployments.specs import profile_engine_spec
from controlplane.inventory.models import Node


class RenderError(FieldError):
    """The profile cannot be rendered the way asked; the message says what to change."""


@dataclass(frozen=True)
class Rendered:
    lines: tuple[str, ...]  # one shell command per engine, GPU first
    notes: tuple[str, ...]  # comments: where the values came from, what was left out

    @property
    def text(self) -> str:
        return "\n".join([*(f"# {n}" for n in self.notes), *self.lines]) + "\n"


def _names(profile: DeploymentProfile) -> tuple[str, str]:
    return (f"syshax-{profile.name}-gpu", f"syshax-{profile.name}-cpu")


def _wrap(argv: list[str], starts: set[int]) -> str:
    """A shell line broken before each long option and at ``starts`` (where the image or the
    engine's command begins), as the documents print their docker runs."""
    out = ""
    for i, arg in enumerate(argv):
        word = shlex.quote(arg)
        if i and (arg.startswith("--") or i in starts):
            out += " \\\n    " + word
        else:
            out += (" " if i else "") + word
    return out


def _process_line(spec: EngineSpec, role: str) -> str:
    if not spec.command:
        field = f"{role}_command"
        raise RenderError(
            field,
            f"the profile has no {field}: the process runtime needs the engine's full command "
            "(it has no image entrypoint); set it, or render with --docker",
        )
    env = dict(spec.env)
    if spec.kv_connector:
        env = prepend_python_path(env, str(kv_connector_dir()))
    argv = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    if spec.cpuset:
        argv += ["taskset", "-c", spec.cpuset]  # the runtime sets the same affinity before exec
    return _wrap([*argv, *spec.argv], {len(argv)})


def _docker_line(spec: EngineSpec, role: str, gpu_name: str) -> str:
    field = f"{role}_image"
    if not spec.image:
        raise RenderError(field, f"the profile has no {field}: a docker run needs an image")
    kwargs = container_kwargs(
        spec.name or role,
        spec,
        {},
        role,
        gpu_name if role == "cpu" else None,
        kv_connector_source=str(kv_connector_dir()) if spec.kv_connector else None,
    )
    argv = docker_run_argv(kwargs, labels=False)
    return _wrap(argv, {argv.index(spec.image, 3)})


def render_profile(
    profile: DeploymentProfile,
    node: Node | None = None,
    *,
    docker: bool = False,
    show_secrets: bool = True,
) -> Rendered:
    """The engine command lines of ``profile`` on ``node``. ``show_secrets=False`` replaces the
    values of the profile's own ``gpu_env``/``cpu_env`` (where tokens sit) with ``<hidden>``.

    Raises ``RenderError`` or ``PlacementError`` (both name the field) when it cannot."""

    plan = placement_plan(profile, node) if node is not None else {}
    names = _names(profile)
    roles = ["gpu", "cpu"] if profile.enable_cpu_engine else ["gpu"]
    notes = [
        f"profile {profile.name} ({profile.engine})"
        + (f" on node {node.name}" if node is not None else " (no node: no cpuset or devices)"),
    ]
    lines = []
    for role in roles:
        spec = profile_engine_spec(profile, role, node=node, plan=plan, names=names)
        if not show_secrets:
            own = profile.gpu_env if role == "gpu" else profile.cpu_env
            spec = replace(spec, env=hide_env(spec.env, own))
        if docker:
            lines.append(_docker_line(spec, role, names[0]))
        else:
            lines.append(_process_line(spec, role))
    if docker and len(roles) == 2:
        notes.append(
            f"start the GPU engine first: the CPU engine joins its IPC namespace ({names[0]})"
        )
    if profile.uses_kv_connector:
        notes.append(f"KV connector from this installation: {kv_connector_dir()}")
    if not show_secrets and (profile.gpu_env or profile.cpu_env):
        notes.append(f"values of the profile's own env are {HIDDEN}: you may not change profiles")
    return Rendered(tuple(lines), tuple(notes))


__all__ = ["PlacementError", "RenderError", "Rendered", "render_profile"]
