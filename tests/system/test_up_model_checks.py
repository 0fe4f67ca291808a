"""`syshax up --engine vllm` checks the model directory before anything starts: one line
naming the cause, exit code 2, and no stack, no engine, no database touched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def up(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"SYSHAX_VAR_DIR": str(tmp_path / "var"), "SYSHAX_ENV_FILE": str(tmp_path / "none.env")}
    return subprocess.run(
        [sys.executable, "-m", "syshax.cli", "up", "--engine", "vllm", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **env},
    )


@pytest.mark.parametrize(
    ("make", "extra", "expected"),
    [
        (lambda root: None, [], "model: {root} does not exist"),
        (lambda root: root.mkdir(), [], "model: {root} has no config.json"),
        (
            lambda root: (
                root.mkdir(),
                (root / "config.json").write_text(
                    json.dumps({"architectures": ["LlamaForCausalLM"], "n_positions": 1024})
                ),
            ),
            ["--max-model-len", "2048"],
            "--max-model-len: 2048 is more than the model allows: 1024 "
            "(n_positions in {root}/config.json)",
        ),
    ],
    ids=["missing", "no-config", "too-long"],
)
def test_a_model_that_cannot_be_served_is_one_line_before_anything_starts(
    tmp_path: Path, make: object, extra: list[str], expected: str
) -> None:
    root = tmp_path / "model"
    make(root)  # type: ignore[operator]
    done = up(tmp_path, "--model", str(root), *extra)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip() == "syshax up: " + expected.format(root=root)
    assert not (tmp_path / "var").exists()  # nothing was set up
