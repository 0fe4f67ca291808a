"""What this agent agrees to run, whatever a command's spec asks for (docs/agent.md, "The
engine policy").

Whoever may edit a profile writes the spec every node's agent runs, so the agent checks it
against its own configuration before anything starts: the image, the program and its
arguments, the environment, the working directory and the mounts. By default only the
engine kinds the project issues pass (vLLM's OpenAI server and the simulator, see
:mod:`.programs`); each widening is an agent flag, logged as a warning at start. A refused spec
fails its command with one line naming the field and the rule (``SpecError``).
"""

from __future__ import annotations

import os
import posixpath
import sys
from dataclasses import dataclass, field, replace

from agents.engine_policy.arguments import args_refusal
from agents.engine_policy.environment import env_lifted, env_refusal, python_path_refusal
from agents.engine_policy.programs import check_image, container_engine, host_engine
from common.engine_spec import (
    KV_CONNECTOR_CONTAINER_DIR,
    EngineSpec,
    Mount,
    SpecError,
    kv_connector_dir,
)

__all__ = ["CONTAINER_RUNTIMES", "EnginePolicy"]

# The runtimes that run images (the program is the image's, paths are the image's).
CONTAINER_RUNTIMES = ("docker", "kubernetes")


def _own_interpreter() -> tuple[str, ...]:
    return (os.path.abspath(sys.executable),) if sys.executable else ()


@dataclass(frozen=True)
class EnginePolicy:
    """The agent's rules for engine specs.

    ``mounts`` are the agent's ``--mount``s (a spec may use only those, never more writable);
    ``interpreters`` the absolute paths of the Pythons that may run an engine module (the
    agent's own and ``--engine-python``); the ``allow_*`` fields and ``workdir_roots`` come
    from the widening flags; ``allow_any_engine`` lifts every rule but the mounts'.
    """

    mounts: tuple[Mount, ...] = ()
    interpreters: tuple[str, ...] = field(default_factory=_own_interpreter)
    allow_images: tuple[str, ...] = ()
    allow_commands: tuple[str, ...] = ()
    allow_env: tuple[str, ...] = ()
    allow_engine_args: tuple[str, ...] = ()
    workdir_roots: tuple[str, ...] = ()
    allow_any_engine: bool = False
    search_path: str | None = None  # the engines' PATH (default: the agent's)

    def widenings(self) -> list[str]:
        """The flags that widen the default policy, one line each, for the start-up log."""
        lines = [f"--allow-image {p}" for p in self.allow_images]
        lines += [f"--allow-command {p}" for p in self.allow_commands]
        lines += [f"--allow-env {n}" for n in self.allow_env]
        lines += [f"--allow-engine-arg {a}" for a in self.allow_engine_args]
        if self.allow_any_engine:
            lines.append("--allow-any-engine: any image, program, argument, env and directory")
        return lines

    def check(self, spec: EngineSpec, runtime: str) -> EngineSpec:
        """``spec`` as the runtime named ``runtime`` (``process``, ``docker`` or ``kubernetes``)
        may run it: on the process runtime its program is the absolute path that was checked. Raises
        ``SpecError`` naming the field and the rule."""
        self._check_mounts(spec)
        if self.allow_any_engine:
            return spec
        if runtime in CONTAINER_RUNTIMES:
            check_image(spec.image, self.allow_images)
            engine_args = container_engine(
                spec.command, spec.args, self.interpreters, self.allow_commands
            )
            connector = KV_CONNECTOR_CONTAINER_DIR
        else:
            if not spec.command:
                raise SpecError(
                    "command", "the process runtime has no image entrypoint; give the full argv"
                )
            search_path = self.search_path
            if search_path is None:
                search_path = os.environ.get("PATH", "")
            program, engine_args = host_engine(
                spec.argv, self.interpreters, self.allow_commands, search_path
            )
            spec = replace(spec, command=(program, *spec.command[1:]))
            connector = ""
        reason = args_refusal(engine_args, self.allow_engine_args)
        if reason is not None:
            raise SpecError("args", reason)
        self._check_env(spec, connector)
        self._check_working_dir(spec.working_dir, runtime)
        return spec

    def _check_env(self, spec: EngineSpec, connector: str) -> None:
        for name, value in spec.env.items():
            reason = env_refusal(name, value, self.allow_env)
            if reason is None and name == "PYTHONPATH" and not env_lifted(name, self.allow_env):
                # The connector's directory is looked up only when a spec names one.
                reason = python_path_refusal(value, connector or str(kv_connector_dir()))
            if reason is not None:
                raise SpecError("env", reason)

    def _check_working_dir(self, working_dir: str | None, runtime: str) -> None:
        if working_dir is None:
            return
        if runtime in CONTAINER_RUNTIMES:  # a path in the image: no symlinks of the host to follow
            path, roots = posixpath.normpath(working_dir), self.workdir_roots
        else:
            path = os.path.realpath(working_dir)
            roots = tuple(os.path.realpath(r) for r in self.workdir_roots)
        if posixpath.isabs(path) and any(
            path == root or path.startswith(root.rstrip("/") + "/") for root in roots
        ):
            return
        raise SpecError(
            "working_dir",
            f"{working_dir!r} is outside this agent's engine directories "
            f"({', '.join(self.workdir_roots) or 'none'}); widen with --allow-workdir",
        )

    def _check_mounts(self, spec: EngineSpec) -> None:
        for mount in spec.mounts:
            own = [m for m in self.mounts if m.source == mount.source]
            if not own:
                allowed = ", ".join(m.source for m in self.mounts) or "none"
                raise SpecError(
                    "mounts",
                    f"host path {mount.source!r} is not one of this agent's --mount paths "
                    f"({allowed})",
                )
            if not any(m.target == mount.target for m in own):
                raise SpecError(
                    "mounts",
                    f"host path {mount.source!r} is mounted at {own[0].target!r} by this agent "
                    f"(--mount), not at {mount.target!r}",
                )
            if mount.read_only is not True and all(
                m.read_only for m in own if m.target == mount.target
            ):
                raise SpecError(
                    "mounts",
                    f"host path {mount.source!r} is read-only on this agent "
                    f"(--mount {mount.source}:{mount.target}:ro); a spec cannot make it writable",
                )
