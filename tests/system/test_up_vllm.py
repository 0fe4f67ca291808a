"""`syshax up --engine vllm`: the whole stack on two real vLLM engines (on the CPU here), the
agent's process runtime launching both from the profile, PD through the KV connector.

The model is the tier's second shape (1,024 positions): `syshax up` once forced a context of
2,048 that vLLM refuses for it; now the engines serve the model's own length."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed.vllm_env import ensure_tiny_model, ensure_vllm
from tests.system.test_up import ROOT, listening, processes_mentioning, up_command


@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_up_on_real_vllm_engines_serves_pd_equal_to_gpu_only(tmp_path) -> None:
    python = ensure_vllm()
    model = ensure_tiny_model(wide=True)
    var_dir = tmp_path / "var"
    argv, env, ports = up_command(
        tmp_path, "--engine", "vllm", "--model", str(model), "--engine-python", str(python)
    )
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "both engines run on the CPU" in output
    assert "context 1,024 tokens (the model's own)" in output
    assert output.index("start-gpu: GPU engine") < output.index("start-cpu: CPU engine")
    assert "equals the GPU-only answer token for token: yes" in output, output[-3000:]
    assert "hit=1.0" in output
    cpu_log = (var_dir / "agent" / "logs").glob("*-cpu.log")
    assert any("SyshaxShmConnector" in p.read_text(errors="replace") for p in cpu_log)
    assert "stopped." in output
    assert processes_mentioning(str(var_dir)) == []
    for port in ports:
        assert not listening(int(port)), f"port {port} still served after shutdown"


def test_up_vllm_needs_a_model(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "syshax.cli", "up", "--engine", "vllm"],
        cwd=ROOT,
        env={**os.environ, "SYSHAX_VAR_DIR": str(tmp_path / "var")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stdout.strip() == "syshax up: --engine vllm needs --model PATH (a model directory)"
    )
