"""PD on a second model shape, so no layout assumption hides behind the tier's first model.

The tier's model has 2 layers of 2 KV heads of 64 and 4,096 positions. This one
(``testbed/tiny_model.py --wide``) has 3 layers of 8 KV heads of 128, no grouped-query attention,
bfloat16 where this CPU computes in it, and 1,024 positions. Its engines are started without
``--max-model-len``: vLLM derives the length from the model's own config.json, and the model
card reader (common/model_card.py) must agree with it.

Through the router at temperature 0, a PD answer must equal the gpu-only answer token for
token, and the decode engine's counters must show it loaded every prompt token.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.model_card import read_model_card
from common.supervisor import free_port
from testbed.vllm_env import VllmEngine, connector_config, ensure_tiny_model
from tests.realengine.conftest import CONNECTOR_EXTRA, CPU_ARENA, FORCED_PD, Pair
from tests.realengine.test_pd import _body, ask
from tests.router.router_procs import Proc, metric

pytestmark = pytest.mark.timeout(1200)

# A 128-token page of this model is 512 KiB a layer: slabs of that size, room for a few.
WIDE_GPU_ARENA = {"arena_mib": 24, "slab_kib": 512}


@pytest.fixture(scope="module")
def wide() -> Iterator[tuple[Pair, Proc]]:
    model = ensure_tiny_model(wide=True)
    workdir = Path(tempfile.mkdtemp(prefix="syshax-wide-"))
    shm = workdir / "shm"
    shm.mkdir()
    started: list[VllmEngine] = []
    router: Proc | None = None
    try:
        for role, peer, cpus, arena in (
            ("gpu", "cpu", "0", WIDE_GPU_ARENA),
            ("cpu", "gpu", "1", CPU_ARENA),
        ):
            started.append(
                VllmEngine(
                    role,
                    free_port(),
                    workdir,
                    cpus=cpus,
                    model=model,
                    max_model_len=None,
                    kv_transfer_config=connector_config(
                        role, peer, shm, **CONNECTOR_EXTRA, **arena
                    ),
                )
            )
        for engine in started:
            engine.wait_ready()
        gpu, cpu = started
        policy = workdir / "policy.json"
        policy.write_text(json.dumps(FORCED_PD))
        router = Proc(
            "router",
            [
                "router",
                "--gpu-url", gpu.url,
                "--cpu-url", cpu.url,
                "--model", "tiny",
                "--pd-protocol", "vllm",
                "--policy", str(policy),
                # The tier's routers let any client force a mode: the gpu-only reference.
                "--mode-header", "all",
            ],
            workdir,
        )  # fmt: skip
        yield Pair("vllm", gpu, cpu, shm, workdir), router
    finally:
        if router is not None:
            router.stop()
        for engine in started:
            engine.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_model_card_says_what_vllm_derives(wide: tuple[Pair, Proc]) -> None:
    pair, _ = wide
    card = read_model_card(ensure_tiny_model(wide=True))
    assert card.max_model_len == 1024
    for engine in (pair.gpu, pair.cpu):
        (served,) = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"]
        assert served["max_model_len"] == card.max_model_len
    # The KV geometry this test exists for, as the connector logged it.
    log = pair.gpu.log_text()
    assert "SyshaxShmConnector gpu" in log


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_pd_on_the_second_geometry_equals_gpu_only(wide: tuple[Pair, Proc], chat: bool) -> None:
    pair, router = wide
    hits_before = pair.cpu.metric("vllm:external_prefix_cache_hits_total")
    kv_before = metric(router, "syshax_router_kv_transfers_total", outcome="hit")
    body = _body(chat, stream=True, max_tokens=32)
    gpu_only = ask(router.url, body, mode="gpu-only")
    pd = ask(router.url, body)
    assert gpu_only["route"] == "gpu-only" and pd["route"] == "pd"
    assert len(gpu_only["ids"]) == 32
    assert pd["ids"] == gpu_only["ids"]
    assert pd["text"] == gpu_only["text"]
    injected = pair.cpu.metric("vllm:external_prefix_cache_hits_total") - hits_before
    print(
        f"\nkv-proof geometry=8x128 api={'chat' if chat else 'completions'} "
        f"prompt_tokens={pd['usage']['prompt_tokens']} injected={injected:g}"
    )
    assert injected == pd["usage"]["prompt_tokens"]
    assert metric(router, "syshax_router_kv_transfers_total", outcome="hit") == kv_before + 1
