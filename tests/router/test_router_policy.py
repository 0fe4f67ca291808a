"""Standalone policy: a file (or flags) that changes live, and is rejected when invalid."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

from router_procs import MODEL, Proc, metric, wait_for
from test_router_paths import PROMPT, assert_one_continuous_stream, client, stream_chat


def write_policy(path: Path, **knobs: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(knobs))
    tmp.replace(path)


def test_policy_file_change_applies_within_one_second(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc], tmp_path: Path
) -> None:
    gpu, cpu = engines
    policy = tmp_path / "policy.json"
    write_policy(policy, mode="gpu-only")
    router = router_factory(gpu.url, cpu.url, "--policy", str(policy))
    assert stream_chat(router, 3)[0] == "gpu-only"
    before = router.get("/health").json()["policy_version"]
    changed_at = time.monotonic()
    write_policy(policy, mode="forced-pd")
    wait_for(
        lambda: router.get("/health").json()["mode"] == "forced-pd", timeout=1.0, interval=0.02
    )
    assert time.monotonic() - changed_at <= 1.0
    assert router.get("/health").json()["policy_version"] == before + 1
    assert stream_chat(router, 3)[0] == "pd"
    assert metric(router, "syshax_router_policy_version", policy="default") == before + 1


def test_sighup_reloads_a_yaml_policy(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc], tmp_path: Path
) -> None:
    gpu, cpu = engines
    policy = tmp_path / "policy.yaml"
    policy.write_text("mode: cpu-only\n")
    router = router_factory(gpu.url, cpu.url, "--policy", str(policy))
    assert stream_chat(router, 3)[0] == "cpu-only"
    policy.write_text("mode: gpu-only\nalgorithm: syshax-threshold\n")
    router.signal(signal.SIGHUP)
    wait_for(lambda: router.get("/health").json()["algorithm"] == "syshax-threshold", timeout=1)
    assert stream_chat(router, 3)[0] == "gpu-only"


def test_invalid_policy_is_rejected_and_the_last_good_one_kept(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc], tmp_path: Path
) -> None:
    gpu, cpu = engines
    policy = tmp_path / "policy.json"
    write_policy(policy, mode="forced-pd")
    router = router_factory(gpu.url, cpu.url, "--policy", str(policy))
    version = router.get("/health").json()["policy_version"]
    write_policy(policy, mode="forced-pd", gpu_cache_threshold=150)
    wait_for(lambda: metric(router, "syshax_router_policy_rejections_total") == 1, timeout=2)
    policy.write_text("{ not json")
    wait_for(lambda: metric(router, "syshax_router_policy_rejections_total") == 2, timeout=2)
    health = router.get("/health").json()
    assert (health["mode"], health["policy_version"]) == ("forced-pd", version)
    assert stream_chat(router, 3)[0] == "pd"
    assert "gpu_cache_threshold: must be at most 100" in router.log_text()


def test_an_invalid_policy_at_start_refuses_to_start(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc], tmp_path: Path
) -> None:
    gpu, cpu = engines
    policy = tmp_path / "policy.json"
    write_policy(policy, token_limit_min=50, token_limit_max=10)
    try:
        router_factory(gpu.url, cpu.url, "--policy", str(policy))
    except RuntimeError as exc:
        assert "token_limit_min" in str(exc)
    else:
        raise AssertionError("the router started with an invalid policy")


def test_live_change_moves_a_running_sequence_back_to_the_gpu(
    engines: tuple[Proc, Proc],
    slow_cpu: Proc,
    router_factory: Callable[..., Proc],
    tmp_path: Path,
) -> None:
    """Capacity decider: offloaded while the GPU is at max_num_seqs; when the policy raises
    the limit, the next re-decision brings the sequence back without a visible seam."""
    gpu, _ = engines
    policy = tmp_path / "policy.json"
    write_policy(policy, max_num_seqs=1, token_limit_min=5, token_limit_max=5)
    router = router_factory(gpu.url, slow_cpu.url, "--policy", str(policy))
    c = client(router)
    with c.chat.completions.with_streaming_response.create(
        model=MODEL, messages=PROMPT, max_tokens=3000, stream=True
    ) as blocker:
        lines = blocker.iter_lines()
        next(lines)
        chunks = []
        with c.chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=PROMPT,
            max_tokens=80,
            stream=True,
            stream_options={"include_usage": True},
        ) as raw:
            assert raw.headers["x-syshax-route"] == "pd"
            for chunk in raw.parse():
                chunks.append(chunk)
                if len(chunks) == 8:
                    write_policy(policy, max_num_seqs=64, token_limit_min=5, token_limit_max=5)
    assert_one_continuous_stream(chunks, 80)
    assert metric(router, "syshax_router_decode_chunks_total", device="gpu") == 1
    assert metric(router, "syshax_router_decode_chunks_total", device="cpu") >= 2


def test_flags_override_the_file(
    engines: tuple[Proc, Proc], router_factory: Callable[..., Proc], tmp_path: Path
) -> None:
    gpu, cpu = engines
    policy = tmp_path / "policy.json"
    write_policy(policy, mode="cpu-only")
    router = router_factory(gpu.url, cpu.url, "--policy", str(policy), "--mode", "gpu-only")
    assert stream_chat(router, 2)[0] == "gpu-only"
    try:
        router_factory(gpu.url, cpu.url, "--max-num-seqs", "zero")
    except RuntimeError as exc:
        assert "max_num_seqs: must be an integer" in str(exc)
    else:
        raise AssertionError("a bad knob flag was accepted")
