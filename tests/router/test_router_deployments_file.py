"""Standalone replicas: ``--deployments-file`` lists the deployments (the control plane's
``routing/deployments`` document), and a rewrite lands without a restart; an invalid one is
kept out and counted, and an invalid one at start-up stops the router naming the field."""

from __future__ import annotations

import itertools
import json
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_procs import MODEL, Proc, metric, wait_for
from test_router_paths import PROMPT, assert_one_continuous_stream, client
from test_router_replicas import complete
from test_router_workers import child_pids

pytestmark = pytest.mark.process  # routers started here on their own flags

SERVED = "vllm:request_success_total"
names = itertools.count()


def entry(name: str, gpu_url: str, **fields: Any) -> dict[str, Any]:
    """One deployment as a person writes it: no id (derived from the name), GPU only."""
    return {"name": name, "model": MODEL, "gpu_url": gpu_url, **fields}


def write_deployments(path: Path, *entries: dict[str, Any]) -> None:
    write_text(path, json.dumps({"deployments": list(entries)}))


def write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@pytest.fixture
def start_router(workdir: Path) -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(path: Path, *extra: str) -> Proc:
        args = ["router", "--deployments-file", str(path), "--mode", "gpu-only", *extra]
        proc = Proc(f"deployments-file-{next(names)}", [*args, "--log-level", "INFO"], workdir)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def backend_urls(router: Proc) -> list[str]:
    return sorted(b["url"] for b in router.get("/health").json()["backends"])


def served(router: Proc, engines: list[Proc], count: int) -> list[float]:
    """How many of ``count`` concurrent completions each engine served."""
    before = [metric(e, SERVED) for e in engines]
    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(lambda _: complete(router), range(count)))
    assert [a.status_code for a in answers] == [200] * count

    def deltas() -> list[float]:
        return [metric(e, SERVED) - b for e, b in zip(engines, before, strict=True)]

    wait_for(lambda: sum(deltas()) == count)
    return deltas()


def test_replicas_from_the_file_share_the_load_and_a_rewrite_lands_without_a_restart(
    engines: tuple[Proc, Proc],
    slow_cpu: Proc,
    start_router: Callable[..., Proc],
    tmp_path: Path,
) -> None:
    gpu, _ = engines
    # The first replica's engine is slow (2x), so a stream is still going when it is dropped.
    leaving, staying = entry("leaving", slow_cpu.url), entry("staying", gpu.url)
    path = tmp_path / "deployments.json"
    write_deployments(path, leaving, staying)
    router = start_router(path)
    pid = router.get("/health").json()["pid"]
    assert backend_urls(router) == sorted([slow_cpu.url, gpu.url])
    (model,) = router.get("/v1/models").json()["data"]
    assert (model["id"], model["deployments"]) == (MODEL, ["leaving", "staying"])
    assert all(count > 0 for count in served(router, [slow_cpu, gpu], 12))

    # Dropped while it streams: the stream finishes there, new requests go to the other.
    chunks = []
    with client(router).chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=PROMPT,
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        for chunk in raw.parse():
            chunks.append(chunk)
            if len(chunks) == 5:
                write_deployments(path, staying)
                closing = wait_for(lambda: router.get("/health").json()["closing"], timeout=2)
                assert closing == [{"url": slow_cpu.url, "role": "gpu", "inflight": 1}]
    assert_one_continuous_stream(chunks, 60)
    assert metric(router, "syshax_router_failovers_total") == 0
    wait_for(lambda: router.get("/health").json()["closing"] == [])
    assert backend_urls(router) == [gpu.url]
    assert served(router, [slow_cpu, gpu], 4) == [0, 4]

    # Added back under a new name: both serve again.
    write_deployments(path, staying, entry("returning", slow_cpu.url))
    wait_for(lambda: len(backend_urls(router)) == 2, timeout=2)
    assert all(count > 0 for count in served(router, [gpu, slow_cpu], 12))
    assert router.get("/health").json()["pid"] == pid, "the router restarted"
    log = router.log_text(20_000)
    assert "(added: none; removed: leaving)" in log
    assert "(added: returning; removed: none)" in log
    assert metric(router, "syshax_router_deployment_rejections_total") == 0


def test_an_invalid_rewrite_is_counted_and_the_last_good_set_stays(
    engines: tuple[Proc, Proc],
    slow_cpu: Proc,
    start_router: Callable[..., Proc],
    tmp_path: Path,
) -> None:
    gpu, _ = engines
    good = [entry("a", gpu.url), entry("b", slow_cpu.url)]
    path = tmp_path / "deployments.yaml"
    write_text(path, json.dumps({"deployments": good}))  # JSON is YAML too
    router = start_router(path)
    rejected = "syshax_router_deployment_rejections_total"
    assert metric(router, rejected) == 0

    bad_rewrites = [
        # a field wrong: named with its entry
        ({"deployments": [good[0], {**good[1], "gpu_url": 7}]}, "deployments[1]: deployment "),
        # two replicas of one name and no ids: their ids would be one
        ({"deployments": [good[0], {**good[1], "name": "a"}]}, "names must be distinct"),
    ]
    for count, (document, words) in enumerate(bad_rewrites, start=1):
        write_text(path, json.dumps(document))
        wait_for(lambda n=count: metric(router, rejected) == n, timeout=2)
        assert words in router.log_text(20_000)
    write_text(path, "deployments: [unclosed\n")
    wait_for(lambda: metric(router, rejected) == 3, timeout=2)
    assert "not valid YAML" in router.log_text(20_000)
    router.signal(signal.SIGHUP)  # a hangup reads it again, and refuses it again
    wait_for(lambda: metric(router, rejected) == 4, timeout=2)

    assert backend_urls(router) == sorted([gpu.url, slow_cpu.url])
    assert complete(router).status_code == 200
    assert "keeping the last good (2 deployments)" in router.log_text(20_000)
    write_text(path, f"deployments:\n  - {{name: a, model: m, gpu_url: '{gpu.url}'}}\n")
    wait_for(lambda: backend_urls(router) == [gpu.url], timeout=2)
    assert metric(router, rejected) == 4


def test_an_invalid_file_at_start_stops_the_router_naming_the_field(
    start_router: Callable[..., Proc], tmp_path: Path
) -> None:
    path = tmp_path / "deployments.json"
    write_deployments(path, entry("a", "http://127.0.0.1:9", cpu_max_num_seqs=0))
    with pytest.raises(RuntimeError) as failed:
        start_router(path)
    message = str(failed.value)
    assert f"invalid deployments file {path}" in message
    assert "deployments[0]: deployment field 'cpu_max_num_seqs' must be a positive integer" in (
        message
    )


def test_every_worker_watches_the_file(
    engines: tuple[Proc, Proc],
    slow_cpu: Proc,
    start_router: Callable[..., Proc],
    tmp_path: Path,
) -> None:
    gpu, _ = engines
    path = tmp_path / "deployments.json"
    write_deployments(path, entry("a", gpu.url))
    router = start_router(path, "--workers", "2")
    workers = child_pids(router.popen.pid)
    assert len(workers) == 2
    write_deployments(path, entry("a", gpu.url), entry("b", slow_cpu.url))

    def seen_by_both() -> bool:
        """Both workers have answered with the two replicas, on fresh connections."""
        seen: set[int] = set()
        for _ in range(40):
            health = httpx.get(router.url + "/health", timeout=10).json()
            if len(health["backends"]) != 2:
                return False
            seen.add(int(health["pid"]))
        return seen == workers

    wait_for(seen_by_both, timeout=5, interval=0.1)
