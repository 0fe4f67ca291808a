"""Which programs and images an engine may be (docs/agent.md, "The engine policy").

The engine kinds this agent knows start in a few ways: vLLM's OpenAI server
(``python -m vllm.entrypoints.openai.api_server``, ``vllm serve``) and the simulator
(``syshax sim``, ``python -m syshax.cli sim``). On the process runtime the program is looked
up on the agent's ``PATH`` and compared as an absolute path: the interpreters are the agent's
own and those named by ``--engine-python`` (or a ``python3*`` beside one of them), and the
``vllm`` / ``syshax`` scripts must sit beside one of them. In a container the program is a
path in the image, so its name counts there, in the image's usual places.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from common.engine_spec import SpecError

PYTHON = re.compile(r"python(3(\.\d+)?)?")
# module run with ``python -m`` -> the subcommand it must be given (None: none)
ENGINE_MODULES: dict[str, str | None] = {
    "vllm.entrypoints.openai.api_server": None,
    "vllm.entrypoints.cli.main": "serve",
    "syshax.cli": "sim",
}
ENGINE_SCRIPTS = {"vllm": "serve", "syshax": "sim"}
# Where engine images install python, vllm and syshax.
IMAGE_BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/bin", "/opt/venv/bin")
# Repositories of the engine images (any tag or digest): vLLM's GPU and CPU images, the
# vllm-ascend image, and the project's own image, which holds `syshax sim`.
ENGINE_IMAGES = (
    "vllm/vllm-openai",
    "vllm/vllm-cpu",
    "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo",
    "quay.io/ascend/vllm-ascend",
    "syshax-controlplane",
)
ENTRY_POINTS = "python -m vllm.entrypoints.openai.api_server, vllm serve or syshax sim"


def image_repository(image: str) -> str:
    """``docker.io/vllm/vllm-openai:v1@sha256:…`` -> ``vllm/vllm-openai``."""
    ref = image.split("@", 1)[0]
    if ref.rfind(":") > ref.rfind("/"):
        ref = ref[: ref.rfind(":")]
    for prefix in ("docker.io/", "index.docker.io/", "localhost/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix) :]
            break
    return ref.removeprefix("library/")


def check_image(image: str, patterns: Sequence[str]) -> None:
    if not image:
        raise SpecError("image", "the docker runtime needs an image")
    if image_repository(image) in ENGINE_IMAGES or any(fnmatchcase(image, p) for p in patterns):
        return
    raise SpecError(
        "image",
        f"{image!r} is not an engine image this agent runs ({', '.join(ENGINE_IMAGES)}, any "
        "tag); widen with --allow-image",
    )


def path_matches(path: str, pattern: str) -> bool:
    """A shell pattern matched one path segment at a time: ``/opt/vllm-*/bin/python`` matches
    ``/opt/vllm-0.32/bin/python``, and no ``*`` reaches across a ``/``."""
    parts, wanted = path.split("/"), pattern.split("/")
    return len(parts) == len(wanted) and all(map(fnmatchcase, parts, wanted))


def resolve_program(name: str, search_path: str) -> str:
    """The absolute, normalised path the process runtime executes for ``name``: a bare name
    is looked up in the absolute directories of ``search_path`` (the engines' ``PATH``)."""
    if "/" not in name:
        absolute_dirs = os.pathsep.join(d for d in search_path.split(os.pathsep) if d[:1] == "/")
        found = shutil.which(name, path=absolute_dirs)
        if found is None:
            raise SpecError("command", f"program {name!r} is not on the agent's PATH")
        return os.path.normpath(found)
    if not os.path.isabs(name):
        raise SpecError("command", f"program {name!r} must be an absolute path or a bare name")
    return os.path.normpath(name)


def _engine_args(argv: Sequence[str], python: bool, script: str | None) -> list[str] | None:
    """The engine's own arguments when ``argv`` is a known entry point, else None."""
    if python and len(argv) >= 3 and argv[1] == "-m" and argv[2] in ENGINE_MODULES:
        sub = ENGINE_MODULES[argv[2]]
        if sub is None:
            return list(argv[3:])
        if len(argv) >= 4 and argv[3] == sub:
            return list(argv[4:])
    if script is not None and len(argv) >= 2 and argv[1] == ENGINE_SCRIPTS[script]:
        return list(argv[2:])
    return None


def _refused(argv: Sequence[str], where: Iterable[str]) -> SpecError:
    shown = " ".join(argv[:3])
    dirs = ", ".join(sorted(set(where))) or "nowhere"
    return SpecError(
        "command",
        f"{shown!r} is not an engine entry point this agent runs ({ENTRY_POINTS}, from "
        f"{dirs}); widen with --engine-python or --allow-command",
    )


def host_engine(
    argv: Sequence[str], interpreters: Sequence[str], commands: Sequence[str], search_path: str
) -> tuple[str, list[str]]:
    """Process runtime: the absolute program to execute and the engine's own arguments."""
    program = resolve_program(argv[0], search_path)
    dirs = {os.path.dirname(i) for i in interpreters}
    name, where = os.path.basename(program), os.path.dirname(program)
    python = program in interpreters or (where in dirs and PYTHON.fullmatch(name) is not None)
    script = name if where in dirs and name in ENGINE_SCRIPTS else None
    engine = _engine_args([program, *argv[1:]], python, script)
    if engine is not None:
        return program, engine
    if any(path_matches(program, pattern) for pattern in commands):
        return program, list(argv[1:])
    raise _refused([program, *argv[1:]], dirs)


def container_engine(
    command: Sequence[str],
    args: Sequence[str],
    interpreters: Sequence[str],
    commands: Sequence[str],
) -> list[str]:
    """Docker runtime: the engine's own arguments. The program is a path in the image (no
    ``command`` keeps the image's entrypoint); a host interpreter's path counts too, for an
    image that mounts the host's Python (the Podman tests)."""
    argv = [*command, *args]
    if not command:
        return list(args)
    program = posixpath.normpath(command[0]) if "/" in command[0] else command[0]
    name, where = posixpath.basename(program), posixpath.dirname(program)
    host_dirs = {os.path.dirname(i) for i in interpreters}
    placed = where == "" or where in IMAGE_BIN_DIRS or where in host_dirs
    python = placed and PYTHON.fullmatch(name) is not None
    script = name if placed and name in ENGINE_SCRIPTS else None
    engine = _engine_args(argv, python, script)
    if engine is not None:
        return engine
    if any(path_matches(program, pattern) for pattern in commands):
        return list(argv[1:])
    raise _refused(argv, [*IMAGE_BIN_DIRS, *host_dirs])
