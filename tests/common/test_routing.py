"""The routing payload: one definition the control plane writes and every router reads."""

from __future__ import annotations

import pytest

from common.routing import PD_PROTOCOLS, DeploymentSpec, parse_deployments

ENTRY = {
    "id": 7,
    "name": "chat",
    "model": "tiny",
    "policy": "default",
    "pd_protocol": "vllm",
    "generation": 3,
    "state": "running",
    "gpu_url": "http://10.0.0.2:8000",
    "cpu_url": "http://10.0.0.2:8001",
    "cpu_max_num_seqs": 8,
    "priority_scheduling": True,
    "gpu_kv_events_url": "tcp://10.0.0.2:5557",
    "cpu_kv_events_url": None,
    "telemetry": {"gpu_temperature_c": 65.0, "host_memory_percent": 40.0},
}


def test_an_entry_survives_the_round_trip_unchanged() -> None:
    spec = DeploymentSpec.from_api(ENTRY)
    assert spec.as_api() == ENTRY
    assert DeploymentSpec.from_api(spec.as_api()) == spec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gpu_url": ""}, "'gpu_url' is required"),
        ({"name": 5}, "'name' must be a string"),
        ({"id": "7"}, "'id' must be an integer"),
        ({"id": True}, "'id' must be an integer"),
        ({"generation": -1}, "'generation' must be a non-negative integer"),
        ({"pd_protocol": "grpc"}, "pd_protocol must be one of"),
        ({"cpu_max_num_seqs": 0}, "'cpu_max_num_seqs' must be a positive integer"),
        ({"telemetry": "hot"}, "'telemetry' must be an object"),
        ({"gpu_kv_events_url": "http://10.0.0.2:5557"}, "'gpu_kv_events_url' must be a tcp://"),
        ({"cpu_kv_events_url": 5557}, "'cpu_kv_events_url' must be a string"),
        ({"telemetry": {"gpu_temperature_c": "hot"}}, "'gpu_temperature_c' must be a number"),
    ],
)
def test_a_bad_field_is_named(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeploymentSpec.from_api({**ENTRY, **change})


def test_an_entry_without_kv_events_urls_is_read_as_before() -> None:
    older = {k: v for k, v in ENTRY.items() if not k.endswith("_kv_events_url")}
    spec = DeploymentSpec.from_api(older)
    assert spec.gpu_kv_events_url is None and spec.cpu_kv_events_url is None


def test_only_routable_entries_are_read_and_the_shape_is_checked() -> None:
    stopping = {**ENTRY, "id": 8, "state": "stopping", "gpu_url": ""}  # never validated
    specs = parse_deployments({"deployments": [ENTRY, stopping]})
    assert [s.id for s in specs] == [7]
    with pytest.raises(ValueError, match="expected"):
        parse_deployments({"deployments": {}})
    with pytest.raises(ValueError, match="must be an object"):
        parse_deployments({"deployments": [1]})
    assert set(PD_PROTOCOLS) == {"vllm", "syshax"}


def test_a_bad_entry_is_named_by_its_place_in_the_list() -> None:
    with pytest.raises(ValueError, match=r"deployments\[1\]: deployment field 'name'"):
        parse_deployments({"deployments": [ENTRY, {**ENTRY, "name": 5}]})
    with pytest.raises(ValueError, match=r"deployments\[0\]: deployment field 'state'"):
        parse_deployments({"deployments": [{**ENTRY, "state": ["running"]}]})
