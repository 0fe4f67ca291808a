"""The deployments file's reading, without processes: the control plane's document shape and
parser, ids derived from names, and the flags it excludes."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from common.routing import DeploymentSpec, parse_deployments
from router.cli import StartupError, add_arguments, compose
from router.policy.deployments_file import (
    derived_id,
    load_deployments_file,
    parse_deployments_file,
)
from router.policy.standalone import StandalonePolicy
from router.state import Router, ServerConfig


def entry(name: str, port: int, **fields: Any) -> dict[str, Any]:
    return {"name": name, "model": "m", "gpu_url": f"http://127.0.0.1:{port}", **fields}


def test_a_document_the_control_plane_builds_reads_the_same_from_a_file(tmp_path: Path) -> None:
    served = {
        "deployments": [
            DeploymentSpec(
                3, "chat-a", "m", "default", "vllm", "http://10.0.0.2:8000", "http://10.0.0.2:8001"
            ).as_api(),
            DeploymentSpec(
                4, "chat-b", "m", "default", "syshax", "http://10.0.0.3:8000", None
            ).as_api(),
        ]
    }
    path = tmp_path / "deployments.json"
    path.write_text(json.dumps(served))
    assert load_deployments_file(str(path)) == parse_deployments(served)
    assert [s.id for s in load_deployments_file(str(path))] == [3, 4]  # its ids are kept


def test_an_entry_without_an_id_keeps_one_derived_from_its_name_whatever_else_changes() -> None:
    first = parse_deployments_file({"deployments": [entry("a", 1), entry("b", 2)]})
    assert [s.id for s in first] == [derived_id("a"), derived_id("b")]
    assert derived_id("a") != derived_id("b") and 0 < derived_id("a") < 2**53
    # Reordered, one dropped, one added, its engine moved: "b" keeps its id.
    later = parse_deployments_file({"deployments": [entry("c", 3), entry("b", 4)]})
    assert [(s.name, s.id) for s in later] == [("c", derived_id("c")), ("b", derived_id("b"))]
    explicit = parse_deployments_file({"deployments": [entry("a", 1, id=9), entry("b", 2)]})
    assert [s.id for s in explicit] == [9, derived_id("b")]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([entry("a", 1), entry("a", 2)], r"deployments\[1\]\.name 'a' repeats deployments\[0\]"),
        ([entry("a", 1, id=5), entry("b", 2, id=5)], r"deployments\[1\]\.id 5 repeats"),
        ([entry("a", 1, id=derived_id("b")), entry("b", 2)], r"deployments\[1\]\.id \d+ repeats"),
        ([entry("a", 1), {"name": "b", "model": "m"}], r"deployments\[1\]: .*'gpu_url' is requ"),
        ([entry("a", 1, state=["running"])], r"deployments\[0\]: .*'state' must be a string"),
        ([entry("a", 1), "b"], r"deployments\[1\]: each deployment must be an object"),
    ],
)
def test_a_bad_entry_is_named(entries: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_deployments_file({"deployments": entries})


def test_an_entry_not_running_is_skipped_unread_and_repeats_nothing() -> None:
    stopped = {"name": "a", "state": "stopped"}  # no model, no engine: never read
    specs = parse_deployments_file({"deployments": [entry("a", 1), stopped]})
    assert [s.name for s in specs] == ["a"]
    with pytest.raises(ValueError, match="expected"):
        parse_deployments_file([entry("a", 1)])


def rejections(router: Router) -> float | None:
    return router.metrics.registry.get_sample_value("syshax_router_deployment_rejections_total")


def test_a_rejected_file_is_counted_and_the_last_good_set_stays(tmp_path: Path) -> None:
    path = tmp_path / "deployments.yml"
    path.write_text("deployments:\n  - {name: a, model: m, gpu_url: 'http://127.0.0.1:1'}\n")
    router = Router(ServerConfig())
    source = StandalonePolicy(router, None, {}, None, str(path))
    assert source.reload_deployments()
    for bad in ("deployments: [", "deployments:\n  - {name: a, model: m}\n", "[]"):
        path.write_text(bad)
        source.hangup()
    assert rejections(router) == 3
    assert [d.spec.gpu_url for d in router.state.deployments] == ["http://127.0.0.1:1"]
    path.unlink()
    assert not source.reload_deployments()  # a file gone is rejected alike
    assert rejections(router) == 4


def parse_flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu-url", "http://127.0.0.1:9"], "leave out --gpu-url"),
        (["--cpu-url", "http://127.0.0.1:9", "--model", "m"], "leave out --cpu-url, --model"),
        (["--pd-protocol", "vllm"], "leave out --pd-protocol"),
        (["--control-plane", "http://cp", "--token", "sxr_x"], "is for standalone mode"),
    ],
)
def test_flags_that_describe_one_deployment_are_refused_with_the_file(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    path = tmp_path / "deployments.json"
    path.write_text(json.dumps({"deployments": [entry("a", 9)]}))
    args = parse_flags("--deployments-file", str(path), *flags)
    with pytest.raises(StartupError, match=message):
        asyncio.run(compose(args))


def test_the_file_alone_starts_and_the_flag_built_deployment_still_defaults_to_vllm(
    tmp_path: Path,
) -> None:
    path = tmp_path / "deployments.json"
    path.write_text(json.dumps({"deployments": [entry("a", 9), entry("b", 10)]}))

    async def composed(*argv: str) -> list[DeploymentSpec]:
        router, _, _ = await compose(parse_flags(*argv))
        try:
            return [d.spec for d in router.state.deployments]
        finally:
            await router.state.close()

    specs = asyncio.run(composed("--deployments-file", str(path)))
    assert [s.name for s in specs] == ["a", "b"]
    (spec,) = asyncio.run(composed("--gpu-url", "http://127.0.0.1:9", "--model", "m"))
    assert (spec.pd_protocol, spec.id) == ("vllm", 0)
    with pytest.raises(StartupError, match=r"--gpu-url .* or --deployments-file"):
        asyncio.run(composed())
