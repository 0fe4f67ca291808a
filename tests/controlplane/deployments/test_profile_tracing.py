"""A profile turns on both engines' request tracing (docs/tracing.md, "The engines"): vLLM's
``--otlp-traces-endpoint`` and ``--collect-detailed-traces`` with the OTLP/HTTP protocol in
its environment, the simulator's same flag; a bad endpoint is refused naming the field."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from controlplane.deployments.specs import engine_spec
from sim.cli import add_arguments as sim_arguments

COLLECTOR = "http://collector:4318"


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def specs(make_deployment: Any, make_profile: Any, **profile: Any) -> list[dict[str, Any]]:
    deployment = make_deployment(profile=make_profile(**profile))
    return [engine_spec(deployment, "gpu"), engine_spec(deployment, "cpu")]


def test_vllm_engines_trace_over_http_to_the_profiles_collector(
    make_deployment: Any, make_profile: Any
) -> None:
    for spec, role in zip(
        specs(
            make_deployment,
            make_profile,
            engine="vllm",
            quantization="none",
            otlp_traces_endpoint=COLLECTOR,
            trace_detail="all",
            cpu_env={"OTEL_SERVICE_NAME": "decode"},
        ),
        ("gpu", "cpu"),
        strict=True,
    ):
        # A URL with no path gets the OTLP/HTTP traces path: vLLM's HTTP exporter sends there.
        assert flag(spec["args"], "--otlp-traces-endpoint") == f"{COLLECTOR}/v1/traces"
        assert flag(spec["args"], "--collect-detailed-traces") == "all"
        # vLLM exports over gRPC unless told; the collector's port is OTLP/HTTP.
        assert spec["env"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        # Each engine names itself, unless the profile's own environment does.
        expected = "decode" if role == "cpu" else "syshax-engine-gpu"
        assert spec["env"]["OTEL_SERVICE_NAME"] == expected


def test_simulated_engines_take_the_same_flag_and_nothing_vllm_only(
    make_deployment: Any, make_profile: Any
) -> None:
    for spec in specs(make_deployment, make_profile, otlp_traces_endpoint=f"{COLLECTOR}/v1/t"):
        parser = argparse.ArgumentParser()
        sim_arguments(parser)
        assert parser.parse_args(spec["args"]).otlp_traces_endpoint == f"{COLLECTOR}/v1/t"
        assert "--collect-detailed-traces" not in spec["args"]
        assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in spec["env"]


def test_without_an_endpoint_no_engine_traces(make_deployment: Any, make_profile: Any) -> None:
    for spec in specs(make_deployment, make_profile, engine="vllm", quantization="none"):
        assert "--otlp-traces-endpoint" not in spec["args"]
        assert not any(name.startswith("OTEL_") for name in spec["env"])


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"otlp_traces_endpoint": "collector:4318"}, "otlp_traces_endpoint", "http(s) URL"),
        ({"otlp_traces_endpoint": "grpc://c:4317"}, "otlp_traces_endpoint", "http(s) URL"),
        ({"otlp_traces_endpoint": "http://"}, "otlp_traces_endpoint", "http(s) URL"),
        ({"engine": "vllm", "trace_detail": "model"}, "trace_detail", "needs otlp_traces"),
        (
            {"otlp_traces_endpoint": COLLECTOR, "trace_detail": "all"},
            "trace_detail",
            "vLLM engines only",
        ),
    ],
)
def test_a_bad_tracing_setting_is_refused_naming_its_field(
    make_profile: Any, fields: dict[str, Any], field: str, words: str
) -> None:
    profile = make_profile(quantization="none")
    for name, value in fields.items():
        setattr(profile, name, value)
    with pytest.raises(ValidationError) as refused:
        profile.clean()
    assert words in refused.value.message_dict[field][0]
    if field == "otlp_traces_endpoint":
        assert "otlp_traces_endpoint" in refused.value.message_dict[field][0]


def test_the_api_refuses_a_bad_endpoint_by_its_field(admin_client: Any, make_profile: Any) -> None:
    profile = make_profile(quantization="none")
    answer = admin_client.patch(
        f"/api/v1/profiles/{profile.pk}/", {"otlp_traces_endpoint": "collector"}, format="json"
    )
    assert answer.status_code == 400
    assert "otlp_traces_endpoint" in answer.content.decode()
