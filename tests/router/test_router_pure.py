"""Pure helpers: metrics parsing, SSE splicing, validation, policy parsing, ejection back-off."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from common.policy_schema import PolicyError, PolicyKnobs
from common.routing import DeploymentSpec
from common.sse import event_data, split_events
from router.cli import BENCHMARK_KEY_ENV, StartupError, add_arguments, benchmark_keys
from router.client.errors import RouterError
from router.client.sse import ChunkBuilder, chunk_parts
from router.client.validate import check_request, parse_body
from router.engines.backends import Backend, Timeouts, ejection_seconds
from router.engines.load import LoadTracker, derive_load, median_itl_ms, parse_metrics_text
from router.state import parse_policy

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:generation_tokens_total{engine="0",model_name="m"} 1000.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 2.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 5.0
"""


def test_parse_metrics_sums_label_sets_and_reads_v1_names() -> None:
    s = parse_metrics_text(METRICS, at=10.0)
    assert (s.running, s.waiting, s.kv_usage) == (3.0, 1.0, 0.42)
    assert s.generation_tokens == 1000.0 and s.itl_count == 100.0


def test_parse_metrics_reads_legacy_names() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.9\n'
        'vllm:avg_generation_throughput_toks_per_s{model_name="m"} 33.0\n'
    )
    s = parse_metrics_text(text, at=0.0)
    assert s.kv_usage == 0.9 and s.avg_generation_tps == 33.0


def test_derive_load_turns_counters_into_rates() -> None:
    a = parse_metrics_text(METRICS, at=10.0)
    b = parse_metrics_text(
        METRICS.replace("1000.0", "1200.0").replace("} 2.0", "} 3.0").replace("} 100.0", "} 150.0"),
        at=12.0,
    )
    tps, itl = derive_load(a, b, None)
    assert tps == pytest.approx(100.0)
    assert itl == pytest.approx(20.0)  # 1 s over 50 tokens
    # No new tokens: the last known ITL is kept.
    assert derive_load(b, b, 7.0)[1] == 7.0


CAPTURED = Path(__file__).parent / "data" / "vllm-0.32-metrics.txt"


def itl_histogram(counts: dict[str, float], at: float, family: str = "inter_token_latency") -> str:
    """A scrape with only an ITL histogram of cumulative ``counts`` by ``le``."""
    lines = [
        f'vllm:{family}_seconds_bucket{{engine="0",le="{le}",model_name="m"}} {n}'
        for le, n in counts.items()
    ]
    return "\n".join(lines) + "\n"


def test_parse_metrics_reads_the_itl_histogram_of_a_real_engine() -> None:
    sample = parse_metrics_text(CAPTURED.read_text(), at=0.0)
    bounds = [bound for bound, _ in sample.itl_buckets]
    assert bounds[0] == 0.01 and bounds[-1] == float("inf") and bounds == sorted(bounds)
    counts = [n for _, n in sample.itl_buckets]
    assert counts == sorted(counts) and counts[-1] == sample.itl_count


def test_median_itl_is_a_decode_step_whatever_a_prefill_stretched() -> None:
    """Between two scrapes, 15 gaps of about 20 ms and one of 700 ms (a prefill in the
    batch): the mean is 62 ms, the median within the 10-25 ms bucket."""
    before = parse_metrics_text(itl_histogram({"0.01": 0, "0.025": 0, "0.75": 0, "+Inf": 0}, 0), 0)
    after = parse_metrics_text(
        itl_histogram({"0.01": 0, "0.025": 15, "0.75": 16, "+Inf": 16}, 1), 1
    )
    median = median_itl_ms(before, after)
    assert median is not None and 10.0 < median <= 25.0
    assert median == pytest.approx(10.0 + 15.0 * 8 / 15)  # linear within the bucket
    # Older engines' family name, too.
    old = parse_metrics_text(itl_histogram({"0.05": 4, "+Inf": 4}, 0, "time_per_output_token"), 0)
    assert old.itl_buckets == ((0.05, 4.0), (float("inf"), 4.0))


@pytest.mark.parametrize(
    "later,why",
    [
        ({"0.01": 0, "0.025": 0, "0.75": 0, "+Inf": 0}, "no new tokens"),
        ({"0.01": 0, "0.05": 3, "0.75": 3, "+Inf": 3}, "other bounds"),
        ({"0.01": 0, "0.025": 0, "+Inf": 0}, "fewer buckets"),
    ],
)
def test_median_itl_is_unknown_without_comparable_scrapes(
    later: dict[str, float], why: str
) -> None:
    before = parse_metrics_text(itl_histogram({"0.01": 0, "0.025": 0, "0.75": 0, "+Inf": 0}, 0), 0)
    assert median_itl_ms(before, parse_metrics_text(itl_histogram(later, 1), 1)) is None, why
    assert median_itl_ms(None, before) is None
    reset = parse_metrics_text(itl_histogram({"0.01": 0, "0.025": 0, "0.75": 0, "+Inf": 0}, 1), 1)
    grown = parse_metrics_text(itl_histogram({"0.01": 9, "0.025": 9, "0.75": 9, "+Inf": 9}, 0), 0)
    assert median_itl_ms(grown, reset) is None  # counters went back: a restarted engine


def test_an_interval_one_long_prefill_filled_keeps_the_last_decode_step() -> None:
    """Four streams: an interval with 40 gaps of ~20 ms measures the decode step; the next,
    which a 1.5 s prefill filled (one stretched gap a stream), leaves it as it was."""
    tracker = LoadTracker("gpu")

    def scrape(counts: dict[str, float], at: float) -> None:
        text = itl_histogram(counts, at) + 'vllm:num_requests_running{model_name="m"} 4\n'
        tracker.observe(parse_metrics_text(text, at))

    scrape({"0.01": 0, "0.025": 0, "2.5": 0, "+Inf": 0}, 0.0)
    scrape({"0.01": 0, "0.025": 40, "2.5": 40, "+Inf": 40}, 1.0)
    assert tracker.decode_itl_ms is not None and 10.0 < tracker.decode_itl_ms <= 25.0
    first = tracker.decode_itl_ms
    scrape({"0.01": 0, "0.025": 40, "2.5": 44, "+Inf": 44}, 2.5)
    assert tracker.decode_itl_ms == first


def test_split_events_keeps_partial_tail() -> None:
    buf = bytearray(b'data: {"a":1}\n\ndata: [DONE]\n\ndata: {"b"')
    events = split_events(buf)
    assert [event_data(e) for e in events] == [b'{"a":1}', b"[DONE]"]
    assert bytes(buf) == b'data: {"b"'
    assert event_data(b": keep-alive") is None


def test_chunk_parts_chat_and_completion() -> None:
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert chunk_parts(role, chat=True).role_only
    tok = chunk_parts({"choices": [{"delta": {"content": " hi"}}]}, chat=True)
    assert tok.text == " hi" and not tok.role_only
    fin = chunk_parts({"choices": [{"text": "", "finish_reason": "scheduled"}]}, chat=False)
    assert fin.finish_reason == "scheduled"
    usage = chunk_parts({"choices": [], "usage": {"completion_tokens": 3}}, chat=True)
    assert usage.usage == {"completion_tokens": 3}


def test_chunk_builder_is_one_stream() -> None:
    b = ChunkBuilder(chat=True, request_id="chatcmpl-x", model="m", created=1)
    chunks = [b.role(), b.text(" a"), b.finish("length"), b.usage(5, 1)]
    bodies = [json.loads(c[6:]) for c in chunks]
    assert {body["id"] for body in bodies} == {"chatcmpl-x"}
    assert bodies[0]["choices"][0]["delta"]["role"] == "assistant"
    assert bodies[3]["choices"] == [] and bodies[3]["usage"]["total_tokens"] == 6
    tricky = ' "quoted"\n\u00e9\u0000'
    for chat in (True, False):
        builder = ChunkBuilder(chat=chat, request_id="x", model="m", created=1)
        choice = json.loads(builder.text(tricky)[6:])["choices"][0]
        assert (choice["delta"]["content"] if chat else choice["text"]) == tricky


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_type"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model", "missing_field"),
        (b'{"model": 3, "messages": []}', "model", "invalid_type"),
        (b'{"model": "m"}', "messages", "missing_field"),
        (b'{"model": "m", "messages": "hi"}', "messages", "invalid_type"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0]", "invalid_type"),
        (
            b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}',
            "stream",
            "invalid_type",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": "5"}',
            "max_tokens",
            "invalid_type",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": 0}',
            "max_tokens",
            "invalid_value",
        ),
    ],
)
def test_bad_chat_bodies_name_the_problem(raw: bytes, param: str | None, code: str) -> None:
    with pytest.raises(RouterError) as info:
        check_request(parse_body(raw), chat=True)
    assert info.value.status == 400
    assert info.value.param == param and info.value.code == code


def test_completion_needs_a_prompt() -> None:
    with pytest.raises(RouterError) as info:
        check_request({"model": "m", "prompt": {"x": 1}}, chat=False)
    assert info.value.param == "prompt"
    assert check_request({"model": "m", "prompt": "a b", "max_tokens": 4}, chat=False) == (
        "m",
        False,
        False,
        4,
    )


def test_policy_documents_are_validated_with_the_shared_schema() -> None:
    full = {"name": "p", "version": 3, "knobs": PolicyKnobs().as_dict()}
    record = parse_policy(full)
    assert (record.name, record.version) == ("p", 3)
    bad = dict(full, knobs=dict(full["knobs"], gpu_cache_threshold=150))
    with pytest.raises(PolicyError) as info:
        parse_policy(bad)
    assert info.value.field == "gpu_cache_threshold"
    partial = {k: v for k, v in full["knobs"].items() if k != "mode"}
    with pytest.raises(PolicyError):  # the control plane always sends every knob
        parse_policy(dict(full, knobs=partial))
    assert parse_policy({"mode": "gpu-only"}).knobs.mode == "gpu-only"  # a partial file


def test_deployment_spec_from_api() -> None:
    spec = DeploymentSpec.from_api(
        {
            "id": 3,
            "name": "d",
            "model": "m",
            "policy": "default",
            "pd_protocol": "vllm",
            "generation": 2,
            "state": "running",
            "gpu_url": "http://g",
            "cpu_url": None,
        }
    )
    assert spec.pd_protocol == "vllm" and spec.cpu_url is None
    with pytest.raises(ValueError, match="pd_protocol"):
        DeploymentSpec.from_api(
            {"id": 1, "name": "d", "model": "m", "gpu_url": "x", "pd_protocol": "grpc"}
        )


def test_ejection_backs_off_and_caps() -> None:
    assert [ejection_seconds(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    backend = Backend("http://x", "cpu", Timeouts())
    assert not backend.record_failure(100.0, connect_failed=False, may_eject=True)
    assert not backend.record_failure(100.0, connect_failed=False, may_eject=True)
    assert backend.record_failure(100.0, connect_failed=False, may_eject=True)
    assert not backend.available(100.5) and backend.available(101.0)
    # The last available backend is never ejected.
    for _ in range(5):
        assert not backend.record_failure(200.0, connect_failed=False, may_eject=False)
    assert backend.available(200.0)


def test_requests_go_to_the_least_loaded_replica_of_their_model() -> None:
    import asyncio

    from router.state import RouterState

    def spec(ident: int, model: str, port: int) -> DeploymentSpec:
        return DeploymentSpec(
            ident, f"d{ident}", model, "default", "syshax", f"http://127.0.0.1:{port}", None
        )

    async def check() -> None:
        state = RouterState(Timeouts())
        state.set_deployments([spec(1, "a", 9001), spec(2, "a", 9002), spec(3, "b", 9003)])
        try:
            assert sorted(state.by_model) == ["a", "b"]
            first, second = state.by_model["a"]
            first.gpu.inflight = 5
            assert state.choose("a") is second
            second.gpu.inflight = 9
            assert state.choose("a") is first
            assert state.choose("missing") is None
            # A replacement set keeps the pooled backend of a URL it already knew.
            pooled = first.gpu
            state.set_deployments([spec(1, "a", 9001)])
            assert state.by_model["a"][0].gpu is pooled
        finally:
            await state.close()

    asyncio.run(check())


def test_cli_help_lists_every_knob() -> None:
    import argparse

    from common.policy_schema import KNOBS
    from router.cli import add_arguments, parse_size

    parser = argparse.ArgumentParser(prog="syshax router")
    add_arguments(parser)
    text = parser.format_help()
    for knob in KNOBS:
        assert "--" + knob.name.replace("_", "-") in text
    assert parse_size("10MB") == 10 * 1024**2 and parse_size("2KB") == 2048
    assert parse_size("512") == 512


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_sse_events_split_on_any_line_end_even_across_reads(newline: bytes) -> None:
    # The specification allows CRLF, LF and CR line ends; a read may end anywhere, even
    # between the CR and the LF of one line end.
    stream = (
        b": keep-alive"
        + newline * 2
        + b'data: {"a":1}'
        + newline * 2
        + b"data: two"
        + newline
        + b"data: lines"
        + newline * 2
        + b"data: [DONE]"
        + newline * 2
    )
    for cut in range(1, len(stream)):
        buffer = bytearray()
        events = []
        for piece in (stream[:cut], stream[cut:]):
            buffer += piece
            events += split_events(buffer)
        assert [event_data(e) for e in events] == [None, b'{"a":1}', b"two\nlines", b"[DONE]"]
        assert not buffer.strip(), (newline, cut, bytes(buffer))


def test_sse_data_loses_one_leading_space_only() -> None:
    assert event_data(b"data:  two spaces") == b" two spaces"
    assert event_data(b"data:none") == b"none"


def test_sse_at_the_end_of_a_stream_the_rest_is_its_last_event() -> None:
    buffer = bytearray(b'data: {"a":1}\r\n\r\ndata: last\r')
    assert [event_data(e) for e in split_events(buffer)] == [b'{"a":1}']
    assert [event_data(e) for e in split_events(buffer, final=True)] == [b"last"]
    assert not buffer
    assert split_events(bytearray(b"\r\n"), final=True) == []  # a bare line end is no event


def test_every_wire_protocol_of_the_contract_has_its_pd_protocol() -> None:
    from common.routing import PD_PROTOCOLS
    from router.pd.registry import PROTOCOLS

    assert sorted(PROTOCOLS) == sorted(PD_PROTOCOLS)
    assert all(PROTOCOLS[name].name == name for name in PROTOCOLS)


def test_a_benchmark_key_must_differ_from_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv(BENCHMARK_KEY_ENV, " b1, b2 ,,")
    assert benchmark_keys(parser.parse_args([])) == ("b1", "b2")
    flags = parser.parse_args(["--benchmark-key", "f1", "--benchmark-key", "f2"])
    assert benchmark_keys(flags) == ("f1", "f2")  # the flags win over the environment
    with pytest.raises(StartupError, match="must differ from the API key"):
        benchmark_keys(parser.parse_args(["--api-key", "b2"]))
    assert parser.parse_args(["--no-mode-header"]).mode_header == "off"
    assert parser.parse_args([]).mode_header == "benchmark-keys"
