"""The KV connector's own tests (tests/kvconnector) in the interpreter that has torch and
vLLM 0.32: the real-engine tier's virtualenv. They drive both sides of the connector as vLLM
does, on vLLM's own base classes; this test fails when any of them fails, and prints them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from testbed.vllm_env import ensure_pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_connector_tests_pass_beside_vllm() -> None:
    python = ensure_pytest()
    run = subprocess.run(
        [
            str(python), "-m", "pytest", "tests/kvconnector", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "-W", "ignore::pytest.PytestConfigWarning", "-rf",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(run.stdout[-6000:], run.stderr[-2000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout
