"""KV bound to its prompt, and failures that degrade visibly: a transfer for another
prompt, model or adapter, or one without a digest, is recomputed with a counted, logged
cause; the lease counts from publication; a full local hit releases the segment at once; a
failed host registration clears the CUDA error and sends every prefill the fallback."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from kvbench import harness
from tests.kvconnector.pairs import close, make_pair
from tests.kvconnector.test_connector import prefill_and_send, segment_files

shm = harness.load_connector().shm


def refused(consumer: Any, prefill: Any, caplog: pytest.LogCaptureFixture, cause: str) -> None:
    with caplog.at_level(logging.ERROR):
        decode = harness.plan_decode(consumer, prefill)
    assert decode.matched == (0, False)  # nothing loaded: the prompt is recomputed
    assert f"({cause}, 1 so far)" in caplog.text, caplog.text
    assert consumer.scheduler.counts()[cause] == 1


def test_a_transfer_for_another_prompt_is_recomputed_with_a_counted_cause(
    pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    producer, consumer = pair
    prefill, _ = prefill_and_send(producer)
    prefill.prompt = [t + 1 for t in prefill.prompt]  # the router paired it with another
    refused(consumer, prefill, caplog, "digest_mismatch")
    assert "holds the KV of another prompt" in caplog.text


def test_a_transfer_for_another_model_is_recomputed(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    producer, _ = make_pair(shm_dir)
    other = harness.Engine(
        "cpu", "gpu", harness.TINY, device="cpu", backend=harness.CPU, num_blocks=64,
        shm_dir=shm_dir, arena_mib=0, isa="test", model_name="another-model",
    )  # fmt: skip
    try:
        prefill, _ = prefill_and_send(producer)
        refused(other, prefill, caplog, "digest_mismatch")
    finally:
        close((producer, other))


def test_parameters_without_a_digest_are_not_loaded(
    pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Parameters from a producer older than the digest (or stripped of it): nothing binds
    the KV to this prompt, so it is recomputed, counted apart from a mismatch."""
    producer, consumer = pair
    prefill, _ = prefill_and_send(producer)
    prefill.params = {k: v for k, v in prefill.params.items() if k != "prompt_digest"}
    refused(consumer, prefill, caplog, "digest_missing")


def test_the_digest_binds_the_first_num_tokens_the_model_and_the_adapter() -> None:
    digest = shm.prompt_digest([1, 2, 3], "m", None)
    assert digest.startswith("sha256:")
    assert shm.check_digest({"prompt_digest": digest}, [1, 2, 3], "m", None) is None
    for tokens, model, adapter in [([1, 2, 4], "m", None), ([1, 2, 3], "n", None),
                                   ([1, 2, 3], "m", "sql-lora"), ([1, 2], "m", None)]:  # fmt: skip
        assert shm.check_digest({"prompt_digest": digest}, tokens, model, adapter) is (
            shm.Cause.DIGEST_MISMATCH
        )
    assert shm.check_digest({"prompt_digest": 7}, [1, 2, 3], "m", None) is (
        shm.Cause.DIGEST_MISMATCH
    )


def test_the_lease_counts_from_publication_not_planning(shm_dir: Path) -> None:
    producer, consumer = make_pair(shm_dir, lease=2.0)
    try:
        prefill = harness.plan_prefill(producer, 20)
        blocks = list(producer.request_blocks[prefill.rid])
        harness.finish_prefill(producer, prefill)
        planned_end = prefill.params["lease_expires_at"]
        time.sleep(max(0.0, planned_end - 0.4 - time.time()))  # a long step: late copies
        with producer.step(prefill.meta):
            harness.save_layers(producer)
        harness.poll_sent(producer)  # published now, 0.4 s before the planned lease ends
        time.sleep(max(0.0, planned_end + 0.5 - time.time()))
        assert shm.reap_expired(str(shm_dir), claim_grace=2.0, lease=2.0) == []
        decode = harness.plan_decode(consumer, prefill)
        assert decode.matched == (20, True)
        assert decode.rid in harness.run_load(consumer, decode).finished_recving
        assert harness.same_kv(producer, blocks, consumer, decode, 20)
    finally:
        close((producer, consumer))


def test_a_segment_the_consumer_fully_hit_locally_is_released_at_once(
    pair: Any, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    producer, consumer = pair
    prefill, _ = prefill_and_send(producer)
    params = {k: v for k, v in prefill.params.items() if k != "remote_prefill_cached_tokens"}
    req = harness.request("decode-local", [*prefill.prompt, 7], params)
    with caplog.at_level(logging.ERROR):
        assert consumer.scheduler.get_num_new_matched_tokens(req, 20) == (0, False)
        assert segment_files(shm_dir) == []  # its run goes back to the producer now
        assert consumer.scheduler.get_num_new_matched_tokens(req, 20) == (0, False)  # again
    assert caplog.text == ""  # asked again, it is no refusal
    assert consumer.scheduler.counts()["local_hit"] == 1


class RefusingCudart:
    """torch.cuda.cudart() of a driver that refuses to register the arena."""

    def __init__(self) -> None:
        self.cleared = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return 1  # cudaErrorInvalidValue

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return 1


def test_a_failed_host_registration_clears_the_error_and_every_prefill_falls_back(
    pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    producer, _ = pair
    cudart = RefusingCudart()
    with caplog.at_level(logging.ERROR):
        producer.worker._copier.saver.register(cudart)
    assert cudart.cleared == 1
    lines = [r.getMessage() for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(lines) == 1 and "error was cleared" in lines[0], lines
    assert "every prefill falls back" in lines[0]
    for _ in range(3):
        prefill = harness.plan_prefill(producer, 20)
        assert prefill.meta.stores == []  # nothing is copied into pageable memory
        harness.finish_prefill(producer, prefill)
        assert "cudaHostRegister" in prefill.params["syshax_kv_fallback"]
    assert producer.scheduler.counts()["host_register_failed"] == 3
