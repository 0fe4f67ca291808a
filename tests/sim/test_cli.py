"""`syshax sim` flags, environment and process lifecycle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from sim_procs import MODEL, SimFactory

pytestmark = pytest.mark.process

BLOCK_BYTES = 262144 * 16  # KV bytes per token of the 32B model x block size


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "syshax.cli", "sim", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def test_unknown_preset_exits_2() -> None:
    out = run_cli("--device", "tpu-v9", "--model", MODEL)
    assert out.returncode == 2
    assert "a100-80gb" in out.stderr  # the choices are listed


def test_cpu_kv_space_from_env_and_flag(sim_factory: SimFactory) -> None:
    from_env = sim_factory(
        "--device", "kunpeng-920-7280z", "--model", MODEL, env={"VLLM_CPU_KVCACHE_SPACE": "8"}
    )
    assert from_env.info()["num_kv_blocks"] == 8 * 2**30 // BLOCK_BYTES
    assert from_env.info()["role"] == "cpu"
    flag_wins = sim_factory(
        "--device", "kunpeng-920-7280z", "--model", MODEL, "--kv-cache-space", "2",
        env={"VLLM_CPU_KVCACHE_SPACE": "8"},
    )  # fmt: skip
    assert flag_wins.info()["num_kv_blocks"] == 2 * 2**30 // BLOCK_BYTES
    assert flag_wins.info()["max_model_len"] == 2 * 2**30 // 262144  # clipped to what fits


def test_bad_kv_space_env_names_the_variable() -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "lots"}
    out = run_cli("--device", "kunpeng-920-7280z", "--model", MODEL, env=env)
    assert out.returncode != 0
    assert "VLLM_CPU_KVCACHE_SPACE" in out.stderr


def test_gpu_memory_utilization_sizes_the_kv_cache(sim_factory: SimFactory) -> None:
    low = sim_factory("--device", "a100-80gb", "--model", MODEL, "--gpu-memory-utilization", "0.5")
    high = sim_factory("--device", "a100-80gb", "--model", MODEL, "--gpu-memory-utilization", "0.9")
    assert low.info()["role"] == "gpu"
    assert int(low.info()["num_kv_blocks"]) < int(high.info()["num_kv_blocks"])  # type: ignore[call-overload]


def test_model_too_big_for_the_device_fails_clearly() -> None:
    # 7B bf16 weights (15 GB) do not fit in 20% of an 80 GB card plus activations.
    out = run_cli(
        "--device", "a100-80gb", "--model", "qwen2.5-7b-instruct", "--gpu-memory-utilization", "0.2"
    )
    assert out.returncode == 2
    assert "no room for a KV cache" in out.stderr


def test_served_model_name_and_sigterm(sim_factory: SimFactory) -> None:
    sim = sim_factory("--device", "a100-80gb", "--model", MODEL, "--served-model-name", "qwen32b")
    models = httpx.get(f"{sim.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["qwen32b"]
    ok = httpx.post(
        f"{sim.url}/v1/completions", json={"model": "qwen32b", "prompt": "hi", "max_tokens": 1}
    )
    assert ok.status_code == 200
    assert 'model_name="qwen32b"' in httpx.get(f"{sim.url}/metrics").text
    sim.popen.send_signal(signal.SIGTERM)
    assert sim.popen.wait(timeout=10) == 0


def test_accepts_what_an_agent_passes_to_real_vllm(sim_factory: SimFactory) -> None:
    kv_transfer = '{"kv_connector": "SyshaxShmConnector", "kv_role": "kv_both"}'
    sim = sim_factory(
        "--device", "a100-80gb", "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
        "--gpu_memory_utilization", "0.8", "-tp", "1", "--kv-transfer-config", kv_transfer,
        "--enforce-eager", "--dtype", "auto",
    )  # fmt: skip
    info = sim.info()
    assert info["model"] == MODEL and info["served_model_name"] == MODEL
    expected = int((80 * 2**30 * 0.8 - 32.76e9 * 18 / 32 - 2 * 2**30) // BLOCK_BYTES)
    assert info["num_kv_blocks"] == expected


@pytest.mark.parametrize("flag", ["--preemption-mode", "--preemption_mode"])
def test_preemption_mode_is_refused_like_vllm_0_32_without_syshax_compat(flag: str) -> None:
    out = run_cli("--device", "a100-80gb", "--model", MODEL, flag, "swap")
    assert out.returncode == 2
    assert f"error: unrecognized arguments: {flag} swap" in out.stderr


def test_syshax_compat_takes_the_v0_engines_preemption_mode(sim_factory: SimFactory) -> None:
    sim = sim_factory(
        "--device", "a100-80gb", "--model", MODEL, "--preemption_mode", "swap", "--syshax-compat"
    )
    assert sim.info()["model"] == MODEL


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("{not json", "not JSON"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "only SyshaxShmConnector"),
        ('{"kv_connector": "SyshaxShmConnector", "kv_role": "kv_sideways"}', "kv_role"),
    ],
)
def test_an_unusable_kv_transfer_config_exits_2(config: str, says: str) -> None:
    out = run_cli("--device", "a100-80gb", "--model", MODEL, "--kv-transfer-config", config)
    assert out.returncode == 2
    assert says in out.stderr


def test_cpu_binding_scales_compute_and_bandwidth(sim_factory: SimFactory) -> None:
    full = sim_factory("--device", "kunpeng-920-7280z", "--model", MODEL).info()
    one_node = sim_factory(
        "--device", "kunpeng-920-7280z", "--model", MODEL,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0-39"},
    ).info()  # fmt: skip
    spread = sim_factory(
        "--device", "kunpeng-920-7280z", "--model", MODEL, "--cpu-bind", "0-19,40-59,80-99,120-139"
    ).info()
    assert (full["cores"], full["numa_nodes"]) == (160, 4)
    assert (one_node["cores"], one_node["numa_nodes"]) == (40, 1)
    assert (spread["cores"], spread["numa_nodes"]) == (80, 4)
    f = float(full["effective_bandwidth"])  # type: ignore[arg-type]
    assert float(one_node["effective_bandwidth"]) == pytest.approx(f / 4)  # type: ignore[arg-type]
    # Same core count, spread over all four memory controllers: full bandwidth, half compute.
    assert float(spread["effective_bandwidth"]) == pytest.approx(f)  # type: ignore[arg-type]
    flops = float(full["effective_flops"])  # type: ignore[arg-type]
    assert float(spread["effective_flops"]) == pytest.approx(flops / 2)  # type: ignore[arg-type]
