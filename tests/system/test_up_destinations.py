"""`syshax up` tells the control plane which router it may send keys and prompts to
(ROUTER_URLS, docs/decisions/0056-router-destinations-configured.md), and gives web the router
keys too, so the playground answers through the real router."""

from __future__ import annotations

import argparse
from typing import Any

from syshax.commands import up


class Recorder:
    """Stands in for the supervisor: records what would start, starts nothing."""

    def __init__(self) -> None:
        self.started: dict[str, dict[str, str]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str], **_: Any) -> None:
        self.started[name] = env


def test_web_and_the_workers_get_the_router_url_and_its_keys(tmp_path, monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    stack = up.Stack(parser.parse_args(["--router-port", "7123"]), tmp_path)
    recorder = Recorder()
    stack.sup = recorder  # type: ignore[assignment]
    monkeypatch.setattr(stack, "wait_http", lambda *args: None)  # nothing started to wait on
    stack.router_api_key, stack.router_benchmark_key = "sxk_api", "sxk_bench"
    stack.start_control_plane()
    for name in ("web", "worker", "benchmarks", "batches"):
        assert recorder.started[name]["ROUTER_URLS"] == "http://127.0.0.1:7123", name
    for name in ("web", "benchmarks", "batches"):
        env = recorder.started[name]
        assert (env["ROUTER_API_KEY"], env["ROUTER_BENCHMARK_KEY"]) == ("sxk_api", "sxk_bench")
    assert "ROUTER_API_KEY" not in recorder.started["gateway"]
