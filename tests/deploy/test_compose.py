"""docker-compose.yml is consistent with itself, the env example and the Dockerfile.

tests/deploy/test_compose_up.py brings it up for real on Podman; these checks are quick.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
ENV_EXAMPLE = {
    line.split("=", 1)[0]
    for line in (ROOT / ".env.example").read_text().splitlines()
    if line and not line.startswith("#")
}


def test_the_services_of_a_cluster_are_all_there() -> None:
    assert set(SERVICES) == {
        "postgres",
        "redis",
        "limits",
        "web",
        "gateway",
        "worker",
        "benchmarks",
        "batches",
        "beat",
        "router",
        "agent",
        "jaeger",
    }


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_has_a_health_check_and_a_restart_policy(name: str) -> None:
    service = SERVICES[name]
    assert service["healthcheck"]["test"], name
    assert service["restart"] in {"unless-stopped", "always"}, name


def test_redis_persists_with_append_only_and_postgres_has_a_volume() -> None:
    assert "--appendonly" in SERVICES["redis"]["command"]
    assert "yes" in SERVICES["redis"]["command"]
    assert any("/var/lib/postgresql/data" in v for v in SERVICES["postgres"]["volumes"])


def test_the_app_services_get_the_settings_they_need() -> None:
    for name in ("web", "gateway", "worker", "benchmarks", "batches", "beat", "router", "agent"):
        env = SERVICES[name]["environment"]
        assert env["DJANGO_SETTINGS_MODULE"] == "controlplane.settings.production"
        assert SERVICES[name]["env_file"] == "${APP_ENV_FILE:-.env}"
        assert SERVICES[name]["depends_on"]
    for name in ("web", "gateway", "worker", "benchmarks", "batches", "beat"):  # compose network
        env = SERVICES[name]["environment"]
        assert (
            env["DATABASE_URL"].startswith("postgres://")
            and "@postgres:5432/" in env["DATABASE_URL"]
        )
        assert env["REDIS_URL"].startswith("redis://redis:")


def test_the_router_shares_the_tenants_limits_through_a_redis_of_their_own() -> None:
    limits = SERVICES["limits"]
    # On the host network with the router, reachable from this host only, nothing on disk.
    assert limits["network_mode"] == "host" and "ports" not in limits
    assert flag(limits["command"], "--bind") == "127.0.0.1"
    assert flag(limits["command"], "--appendonly") == "no"
    url = SERVICES["router"]["environment"]["SYSHAX_ROUTER_SHARED_LIMITS_URL"]
    assert url == "redis://127.0.0.1:${LIMITS_PORT:-6390}/0"
    # A router starts and serves without it (on local limits): no dependency.
    assert "limits" not in SERVICES["router"]["depends_on"]


def test_the_agent_drives_the_host_docker_engine() -> None:
    agent = SERVICES["agent"]
    assert "${DOCKER_SOCKET:-/var/run/docker.sock}:/var/run/docker.sock" in agent["volumes"]
    assert agent["environment"]["DOCKER_HOST"] == "unix:///var/run/docker.sock"
    assert agent["network_mode"] == "host"
    assert "--runtime" in agent["command"] and "docker" in agent["command"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_router_and_agent_on_the_host_network_reach_the_gateway_by_its_published_port() -> None:
    # Service names do not resolve on the host network, and the engines listen on the host.
    gateway = "http://${CONTROL_PLANE_HOST:-127.0.0.1}:${GATEWAY_PORT:-8010}"
    for name in ("router", "agent"):
        service = SERVICES[name]
        assert service["network_mode"] == "host", name
        assert "ports" not in service, name
        assert flag(service["command"], "--control-plane") == gateway, name
        assert "gateway" in service["depends_on"], name
    # The gateway is the machines' endpoint in front of web, on the compose network.
    assert flag(SERVICES["gateway"]["command"], "--upstream") == "http://web:8000"
    assert SERVICES["gateway"]["ports"] == ["${GATEWAY_PORT:-8010}:8000"]
    assert SERVICES["gateway"]["depends_on"]["web"] == {"condition": "service_healthy"}
    # The agent fetches its commands from web and holds no broker credential: Redis stays on
    # the compose network, unpublished.
    assert "--broker" not in SERVICES["agent"]["command"]
    assert "ports" not in SERVICES["redis"]
    assert "redis" not in SERVICES["agent"]["depends_on"]
    assert SERVICES["web"]["ports"] == ["${WEB_PORT:-8000}:8000"]
    assert flag(SERVICES["router"]["command"], "--port") == "${ROUTER_PORT:-7010}"
    assert "${ROUTER_PORT:-7010}" in SERVICES["router"]["healthcheck"]["test"][1]


def test_images_and_the_base_are_overridable_with_the_official_defaults() -> None:
    assert SERVICES["postgres"]["image"] == "${POSTGRES_IMAGE:-postgres:16}"
    assert SERVICES["redis"]["image"] == "${REDIS_IMAGE:-redis:7}"
    for name in ("web", "worker", "beat", "router", "agent"):
        build = SERVICES[name]["build"]
        assert build["args"]["BASE"] == "${SYSHAX_BASE_IMAGE:-python:3.11-slim}", name
        assert build["network"] == "host", name  # pip reaches PyPI on any engine
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim" in dockerfile and "FROM ${BASE}" in dockerfile


def test_health_checks_are_single_shell_strings() -> None:
    # Podman's Docker API splits the arguments of a ["CMD", ...] test at spaces, which breaks
    # `python -c "..."`; one CMD-SHELL string means the same on every engine.
    for name, service in SERVICES.items():
        test = service["healthcheck"]["test"]
        if test[0] == "CMD":
            assert all(" " not in arg for arg in test[1:]), name
        else:
            assert test[0] == "CMD-SHELL" and len(test) == 2, name


def test_the_tracing_profile_adds_a_collector_that_every_traced_service_may_send_to() -> None:
    # Off unless asked for: only `--profile tracing` starts the collector, and an empty
    # endpoint keeps every service's tracing off (docs/tracing.md).
    assert SERVICES["jaeger"]["profiles"] == ["tracing"]
    assert all("profiles" not in s for name, s in SERVICES.items() if name != "jaeger")
    published = {p.split(":")[-1] for p in SERVICES["jaeger"]["ports"]}
    assert {"4318", "16686"} <= published  # OTLP/HTTP and the viewer
    for name in ("web", "worker", "benchmarks", "batches", "router", "agent"):
        env = SERVICES[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == (
            "${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-}"
        ), name
    assert SERVICES["web"]["environment"]["SYSHAX_TRACE_URL_TEMPLATE"]


def test_the_tokens_may_be_empty_until_issued() -> None:
    # Compose interpolates every service, even those not started: a required ROUTER_TOKEN would
    # stop the documented first start (`up -d postgres redis web worker benchmarks beat`).
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${ROUTER_TOKEN:-}" in text and "${AGENT_TOKEN:-}" in text
    assert "${ROUTER_TOKEN:?" not in text and "${AGENT_TOKEN:?" not in text


def test_every_variable_the_file_uses_is_documented_in_the_env_example() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))
    assert used, "the compose file should be configured through variables"
    assert used <= ENV_EXAMPLE, f"undocumented: {sorted(used - ENV_EXAMPLE)}"
    # Production settings refuse to start without these.
    assert {"SECRET_KEY", "ALLOWED_HOSTS"} <= ENV_EXAMPLE


def test_the_env_example_names_only_variables_the_settings_or_compose_read() -> None:
    documented = (ROOT / "docs" / "configuration.md").read_text()
    compose_only = {
        "POSTGRES_PASSWORD",
        "WEB_PORT",
        "GATEWAY_PORT",
        "ROUTER_PORT",
        "LIMITS_PORT",
        "CONTROL_PLANE_HOST",
        "NODE_ADDRESS",
        "DOCKER_SOCKET",
        "WEB_WORKERS",
        "WORKER_CONCURRENCY",
        "BENCHMARK_CONCURRENCY",
        "BATCH_WORKER_CONCURRENCY",
        "SYSHAX_BASE_IMAGE",
        "POSTGRES_IMAGE",
        "REDIS_IMAGE",
        "APP_ENV_FILE",
        "ROUTER_TOKEN",
        "ROUTER_NAME",
        "AGENT_TOKEN",
        "NODE_NAME",
        "JAEGER_IMAGE",
        "JAEGER_UI_PORT",
        "OTLP_HTTP_PORT",
    }
    for name in ENV_EXAMPLE - compose_only:
        assert f"`{name}`" in documented, f"{name} is not in docs/configuration.md"


def test_the_dockerfile_installs_the_project_and_its_console_script() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install" in dockerfile and "collectstatic" in dockerfile
    for name in ("web", "gateway", "worker", "beat", "router", "agent"):
        assert SERVICES[name]["command"][0] == "syshax"


def compose_client() -> list[str] | None:
    """`docker compose` (the plugin) or `docker-compose` (scripts/dev/compose_setup.sh installs
    Debian's), whichever this machine has."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def compose_config(
    client: list[str], tmp_path: Path, **overrides: str
) -> subprocess.CompletedProcess[str]:
    """``compose config -q`` with the env example, every empty value filled in."""
    values = {
        line.split("=", 1)[0]: line.split("=", 1)[1]
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    env = tmp_path / ".env"
    values["APP_ENV_FILE"] = str(env)  # not the checkout's .env, which may not exist
    values = {name: value or "x" for name, value in values.items()} | overrides
    env.write_text("\n".join(f"{k}={v}" for k, v in sorted(values.items())))
    return subprocess.run(
        [*client, "-f", str(ROOT / "docker-compose.yml"), "--env-file", str(env), "config", "-q"],
        capture_output=True,
        text=True,
        # Compose lets the caller's environment override the env file: give it none.
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)},
    )


def test_the_compose_client_accepts_the_file_with_the_env_example(tmp_path) -> None:
    client = compose_client()
    if client is None:
        # No compose client on this machine: the structural checks above are the test.
        return
    result = compose_config(client, tmp_path)
    assert result.returncode == 0, result.stderr
    # No router API key: compose refuses every command, naming the variable.
    refused = compose_config(client, tmp_path, ROUTER_API_KEY="")
    assert refused.returncode != 0 and "set ROUTER_API_KEY in .env" in refused.stderr


def test_the_router_requires_an_api_key_given_in_its_environment() -> None:
    router = SERVICES["router"]
    assert "--api-key" not in router["command"]
    key = router["environment"]["SYSHAX_ROUTER_API_KEY"]
    assert key == "${ROUTER_API_KEY:?set ROUTER_API_KEY in .env}"


def test_machine_tokens_travel_in_the_environment_not_on_a_command_line() -> None:
    for name, variable in (("router", "SYSHAX_ROUTER_TOKEN"), ("agent", "SYSHAX_AGENT_TOKEN")):
        service = SERVICES[name]
        assert "--token" not in service["command"], name
        assert variable in service["environment"], name


def test_only_the_benchmark_key_may_force_a_mode_and_compose_requires_it() -> None:
    router = SERVICES["router"]
    assert "--benchmark-key" not in router["command"] and "--mode-header" not in router["command"]
    key = router["environment"]["SYSHAX_ROUTER_BENCHMARK_KEY"]
    assert key == "${ROUTER_BENCHMARK_KEY:?set ROUTER_BENCHMARK_KEY in .env}"
