"""What a client may ask of the router (docs/router.md, "Access"): fields only the router
sets never reach an engine from a client, X-Syshax-Mode needs a benchmark key and never
passes the policy's hard limits, and the catch-all forwards listed engine paths only, without
the client's credentials. Recording engine stand-ins show what the engines received."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from recording_engine import TRANSFER, RecordingEngine, Seen
from router_procs import MODEL, Proc, metric, wait_for
from standins import StandInControlPlane, deployment

from router.client.access import bearer, forwarded_headers, key_matches, proxied_path
from router.client.errors import RouterError

USER = "sxk_user"
BENCH = "sxk_bench"
KEYS = ("--api-key", USER, "--benchmark-key", BENCH, "--metrics-interval-seconds", "0.2")
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture
def stubs() -> Iterator[tuple[RecordingEngine, RecordingEngine]]:
    """A GPU and a CPU engine stand-in, recording what they are sent."""
    gpu, cpu = RecordingEngine(), RecordingEngine()
    yield gpu, cpu
    gpu.close()
    cpu.close()


def ask(
    router: Proc, path: str, body: dict[str, Any], key: str = USER, mode: str | None = None
) -> httpx.Response:
    """A request as a client sends it, with its key, a cookie and maybe a forced mode."""
    headers = {"Authorization": f"Bearer {key}", "Cookie": "session=s3cret"}
    if mode is not None:
        headers["X-Syshax-Mode"] = mode
    return httpx.post(router.url + path, json=body, headers=headers, timeout=30)


def generation(path: str, stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": stream, **extra}
    if path.endswith("/chat/completions"):
        body["messages"] = CHAT
    else:
        body["prompt"] = "hello"
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def no_credentials(seen: list[Seen]) -> None:
    for request in seen:
        leaked = {"authorization", "cookie", "x-syshax-mode"} & set(request.headers)
        assert not leaked, (request.path, leaked)


# Every door a client could use, with the key (and forced mode) that opens it.
DOORS = [
    ("/v1/completions", False, USER, None),
    ("/v1/chat/completions", True, USER, None),
    ("/v1/completions", True, BENCH, "cpu-only"),
    ("/v1/chat/completions", False, BENCH, "forced-pd"),
    ("/v1/completions", False, BENCH, "gpu-only"),
]
ROUTER_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("kv_transfer_params", {"kv_transfer_params": {"do_remote_decode": True}}),
    (
        "kv_transfer_params",
        {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "t", "rank": -1}},
    ),
    ("request_id_inference", {"request_id_inference": "another-clients-request"}),
    ("num_decode_tokens", {"num_decode_tokens": 0}),
    ("generated_text", {"generated_text": "so far"}),
    ("vllm_xargs.kv_transfer_params", {"vllm_xargs": {"kv_transfer_params": "x"}}),
]


def test_a_field_only_the_router_sets_is_refused_on_every_path(
    stubs: tuple[RecordingEngine, RecordingEngine], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = stubs
    router = router_factory(gpu.url, cpu.url, *KEYS)
    refused = 0
    for param, fields in ROUTER_FIELDS:
        for path, stream, key, mode in DOORS:
            answer = ask(router, path, generation(path, stream, **fields), key, mode)
            error = error_of(answer, 400)
            assert (error["param"], error["code"]) == (param, "router_only_field"), path
            assert "router only" in error["message"]
            refused += 1
        # The catch-all's engine paths too.
        tokenize = ask(router, "/tokenize", {"model": MODEL, "prompt": "x", **fields})
        assert error_of(tokenize, 400)["param"] == param
        refused += 1
    assert gpu.requests() == [] and cpu.requests() == []
    assert metric(router, "syshax_router_refusals_total", reason="router-field") == refused


def test_empty_router_fields_are_stripped_before_any_engine_sees_them(
    stubs: tuple[RecordingEngine, RecordingEngine], router_factory: Callable[..., Proc]
) -> None:
    """Passthrough, forced modes, PD, a fallback after a failed engine, the catch-all: what
    reaches an engine carries no kv_transfer_params but the router's own."""
    gpu, cpu = stubs
    router = router_factory(gpu.url, cpu.url, *KEYS)
    pd = 0
    empties: tuple[Any, ...] = (None, {})
    for empty in empties:
        fields = {"kv_transfer_params": empty, "request_id_inference": None}
        for path, stream, key, mode in DOORS:
            answer = ask(router, path, generation(path, stream, **fields), key, mode)
            assert answer.status_code == 200, answer.text
            pd += mode == "forced-pd"
        gpu.fail = True  # the GPU's prefill fails: forced-pd falls back to the CPU alone
        fallback = ask(router, "/v1/completions", generation("/v1/completions", True, **fields))
        assert fallback.status_code == 200 and "tok" in fallback.text
        gpu.fail = False
        assert ask(router, "/tokenize", {"model": MODEL, "prompt": "x", **fields}).is_success
    assert metric(router, "syshax_router_fallbacks_total", kind="to-cpu-only") == 2

    gpu_seen, cpu_seen = gpu.requests(), cpu.requests()
    no_credentials(gpu_seen + cpu_seen)
    assert all("request_id_inference" not in (r.body or {}) for r in gpu_seen + cpu_seen)
    # The router's own handoff only: the prefill asks for it, the decode carries its answer.
    prefills = [r.body["kv_transfer_params"] for r in gpu_seen if "kv_transfer_params" in r.body]
    decodes = [r.body["kv_transfer_params"] for r in cpu_seen if "kv_transfer_params" in r.body]
    assert prefills == [{"do_remote_decode": True}] * pd
    assert decodes == [TRANSFER] * pd
    assert any(r.path == "/tokenize" for r in gpu_seen)


@pytest.mark.process
def test_a_request_moved_to_another_replica_carries_no_router_field(
    workdir: Path, stubs: tuple[RecordingEngine, RecordingEngine]
) -> None:
    failing, healthy = stubs
    failing.fail = True
    cp = StandInControlPlane(
        [deployment(1, "a", failing.url), deployment(2, "b", healthy.url)], mode="gpu-only"
    )
    router = cp.start_router(workdir, "replicas-router", "--api-key", USER)
    try:
        wait_for(lambda: len(router.get("/health").json()["backends"]) == 2, timeout=10)
        body = generation("/v1/completions", False, kv_transfer_params={})
        answer = ask(router, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        assert metric(router, "syshax_router_failovers_total", reason="http") == 1
    finally:
        router.stop()
        cp.close()
    for engine in stubs:
        seen = engine.requests()
        assert len(seen) == 1
        no_credentials(seen)
        assert "kv_transfer_params" not in seen[0].body


def test_the_catch_all_forwards_listed_engine_paths_only_and_no_credentials(
    stubs: tuple[RecordingEngine, RecordingEngine], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = stubs
    router = router_factory(gpu.url, cpu.url, *KEYS)
    headers = {
        "Authorization": f"Bearer {USER}",
        "Cookie": "session=s3cret",
        "Proxy-Authorization": "Basic eA==",
        "X-Forwarded-For": "10.0.0.1",
    }
    version = httpx.get(router.url + "/version", headers=headers, timeout=10)
    assert version.status_code == 200 and version.json() == {"version": "recording"}
    tokens = httpx.post(router.url + "/tokenize", json={"prompt": "x"}, headers=headers)
    assert tokens.status_code == 200 and tokens.json()["count"] == 3
    [got_version, got_tokens] = gpu.requests()
    assert (got_version.method, got_version.path) == ("GET", "/version")
    assert got_tokens.body == {"prompt": "x"}
    for seen in (got_version, got_tokens):
        assert not {"authorization", "cookie", "proxy-authorization", "x-forwarded-for"} & set(
            seen.headers
        ), seen.headers

    # An engine's other paths are an operator's: the router answers them itself.
    unlisted = [
        ("POST", "/collective_rpc"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/sleep"),
        ("GET", "/server_info"),
        ("GET", "/v1/embeddingsX"),
        ("POST", "/tokenize/../collective_rpc"),
    ]
    for method, path in unlisted:
        answer = httpx.request(method, router.url + path, json={}, headers=headers, timeout=10)
        error = error_of(answer, 404)
        assert error["code"] == "not_found", path
    wrong_method = httpx.post(router.url + "/version", json={}, headers=headers, timeout=10)
    assert error_of(wrong_method, 405)["code"] == "method_not_allowed"
    assert len(gpu.requests()) == 2 and cpu.requests() == []
    assert metric(router, "syshax_router_refusals_total", reason="path") == len(unlisted) + 1


def test_only_a_benchmark_key_forces_a_mode(
    stubs: tuple[RecordingEngine, RecordingEngine], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = stubs
    router = router_factory(gpu.url, cpu.url, *KEYS)
    body = generation("/v1/completions", False)
    for mode in ("cpu-only", "forced-pd", "gpu-only", "auto", "turbo"):
        error = error_of(ask(router, "/v1/completions", body, USER, mode), 403)
        assert (error["param"], error["code"]) == ("X-Syshax-Mode", "mode_header_not_allowed")
    assert gpu.requests() == [] and cpu.requests() == []
    assert metric(router, "syshax_router_refusals_total", reason="mode-header") == 5
    # The benchmark key gets in like the API key, and may force the mode.
    assert ask(router, "/v1/completions", body, BENCH).headers["x-syshax-route"] == "gpu-only"
    forced = ask(router, "/v1/completions", body, BENCH, "cpu-only")
    assert forced.headers["x-syshax-route"] == "cpu-only"
    bad = ask(router, "/v1/completions", body, BENCH, "turbo")
    assert error_of(bad, 400)["param"] == "X-Syshax-Mode"
    assert error_of(ask(router, "/v1/completions", body, "sxk_wrong", "cpu-only"), 401)

    # --mode-header all: every client that got in may force it; off: nobody, silently.
    every = router_factory(gpu.url, cpu.url, "--api-key", USER, "--mode-header", "all")
    assert ask(every, "/v1/completions", body, USER, "cpu-only").headers["x-syshax-route"] == (
        "cpu-only"
    )
    for off in (("--mode-header", "off"), ("--no-mode-header",)):
        nobody = router_factory(gpu.url, cpu.url, *KEYS, *off)
        ignored = ask(nobody, "/v1/completions", body, BENCH, "cpu-only")
        assert ignored.headers["x-syshax-route"] == "gpu-only"


def scraped(router: Proc, role: str, running: int, waiting: int) -> bool:
    backends = router.get("/health").json()["backends"]
    return any(
        b["role"] == role
        and b["scrape"]["running"] == running
        and b["scrape"]["waiting"] == waiting
        for b in backends
    )


def test_a_forced_mode_still_gets_429_when_the_queue_and_the_cpu_are_full(
    stubs: tuple[RecordingEngine, RecordingEngine], router_factory: Callable[..., Proc]
) -> None:
    gpu, cpu = stubs
    gpu.running, gpu.waiting, cpu.hold = 4, 2, True
    router = router_factory(
        gpu.url,
        cpu.url,
        *KEYS,
        "--max-num-seqs",
        "4",
        "--max-queue-size",
        "2",
        "--cpu-max-batch-size",
        "2",
        "--batch-ttft-ms",
        "200",
    )
    wait_for(lambda: scraped(router, "gpu", 4, 2), timeout=10)
    body = generation("/v1/chat/completions", True)
    limits = {"gpu-only": "max_queue_size", "cpu-only": "cpu_max_batch_size"}
    with (
        held_stream(router, body, "cpu-only") as first,
        held_stream(router, body, "cpu-only") as second,
    ):
        # The CPU runs its batch cap (2), the GPU is saturated with its queue full (2): the
        # policy's own request waits in the router's queue (a batch one, up to its 200 ms
        # TTFT target: docs/slo-classes.md); a forced mode gets its 429 at once.
        policy = error_of(
            ask(router, "/v1/chat/completions", {**body, "service_tier": "flex"}), 429
        )
        assert policy["code"] == "queue_timeout"
        for mode in ("gpu-only", "cpu-only", "forced-pd", "auto"):
            answer = ask(router, "/v1/chat/completions", body, BENCH, mode)
            error = error_of(answer, 429)
            assert error["code"] == "saturated" and answer.headers["retry-after"] == "1"
            assert limits.get(mode, "") in error["message"], (mode, error)
        cpu.release()
        for rest in (first, second):
            assert b"[DONE]" in b"".join(rest)
    assert gpu.requests() == [] and len(cpu.requests()) == 2
    queue = metric(router, "syshax_router_decisions_total", route="rejected", reason="queue-full")
    full = metric(router, "syshax_router_decisions_total", route="rejected", reason="cpu-full")
    assert (queue, full) == (2, 2)  # gpu-only and auto; cpu-only and forced-pd

    # Below the limits the same forced modes are served where they asked.
    gpu.waiting = 1
    wait_for(lambda: scraped(router, "gpu", 4, 1), timeout=10)
    for mode in ("gpu-only", "cpu-only"):
        answer = ask(router, "/v1/chat/completions", body, BENCH, mode)
        assert answer.headers["x-syshax-route"] == mode


@contextmanager
def held_stream(router: Proc, body: dict[str, Any], mode: str) -> Iterator[Iterator[bytes]]:
    """A forced stream under way: its first token arrived, the engine holds the rest (the
    iterator over it, kept referenced: a collected one closes the stream)."""
    headers = {"Authorization": f"Bearer {BENCH}", "X-Syshax-Mode": mode}
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.headers["x-syshax-route"] == mode
        rest = response.iter_raw()
        next(rest)
        yield rest


@pytest.mark.process
def test_a_forced_mode_is_refused_past_the_temperature_and_memory_guards(
    workdir: Path, stubs: tuple[RecordingEngine, RecordingEngine]
) -> None:
    gpu, cpu = stubs

    def node(temperature: float, memory: float) -> list[dict[str, Any]]:
        entry = deployment(1, "hot", gpu.url, cpu.url)
        entry["telemetry"] = {"gpu_temperature_c": temperature, "host_memory_percent": memory}
        return [entry]

    cp = StandInControlPlane(node(95.0, 99.0), gpu_max_temperature_c=90.0)
    router = cp.start_router(workdir, "guarded-router", "--benchmark-key", BENCH)
    try:
        wait_for(lambda: len(router.get("/health").json()["backends"]) == 2, timeout=10)
        body = generation("/v1/completions", False)
        guards = {
            "gpu-only": "gpu_max_temperature_c",
            "cpu-only": "cpu_max_memory_percent",
            "forced-pd": "cpu_max_memory_percent",
        }
        for mode, limit in guards.items():
            error = error_of(ask(router, "/v1/completions", body, BENCH, mode), 429)
            assert limit in error["message"], (mode, error)
        assert gpu.requests() == [] and cpu.requests() == []

        cp.set_deployments(node(60.0, 40.0))
        wait_for(lambda: ask(router, "/v1/completions", body, BENCH, "gpu-only").is_success)
        for mode, route in (("cpu-only", "cpu-only"), ("forced-pd", "pd")):
            answer = ask(router, "/v1/completions", body, BENCH, mode)
            assert answer.headers["x-syshax-route"] == route
    finally:
        router.stop()
        cp.close()


def test_the_access_rules_are_plain_functions() -> None:
    head = {"Content-Type": "application/json", "Authorization": "Bearer k", "Cookie": "c=1"}
    assert forwarded_headers(head) == b"Content-Type: application/json\r\n"
    assert proxied_path("POST", "/tokenize") == "/tokenize"
    with pytest.raises(RouterError) as unlisted:
        proxied_path("POST", "/collective_rpc")
    assert (unlisted.value.status, unlisted.value.code) == (404, "not_found")
    assert key_matches(bearer("Bearer b2"), ("a", "b2")) and not key_matches(b"", ("a",))
    # A header that is not UTF-8 is a wrong key, not a crash.
    assert bearer("Bearer \udcff") == b"\xff" and not key_matches(b"\xff", ("a",))
    assert bearer("Basic a2V5") == b""
