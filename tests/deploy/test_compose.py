"""docker-compose.yml cannot run here (no Docker engine), so check it is consistent."""

from __future__ import annotations

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
    assert set(SERVICES) == {"postgres", "redis", "web", "worker", "beat", "router", "agent"}


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
    for name in ("web", "worker", "beat", "router"):
        env = SERVICES[name]["environment"]
        assert env["DJANGO_SETTINGS_MODULE"] == "controlplane.settings.production"
        assert env["DATABASE_URL"].startswith("postgres://")
        assert env["REDIS_URL"].startswith("redis://redis:")
        assert SERVICES[name]["env_file"] == ".env"
        assert SERVICES[name]["depends_on"]


def test_the_agent_drives_the_host_docker_engine() -> None:
    agent = SERVICES["agent"]
    assert "/var/run/docker.sock:/var/run/docker.sock" in agent["volumes"]
    assert agent["network_mode"] == "host"
    assert "--runtime" in agent["command"] and "docker" in agent["command"]


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
        "ROUTER_PORT",
        "ROUTER_TOKEN",
        "ROUTER_NAME",
        "AGENT_TOKEN",
        "NODE_NAME",
    }
    for name in ENV_EXAMPLE - compose_only:
        assert f"`{name}`" in documented, f"{name} is not in docs/configuration.md"


def test_the_dockerfile_installs_the_project_and_its_console_script() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install" in dockerfile and "collectstatic" in dockerfile
    for name in ("web", "worker", "beat", "router", "agent"):
        assert SERVICES[name]["command"][0] == "syshax"


def test_docker_compose_config_accepts_the_file_when_the_plugin_exists(tmp_path) -> None:
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0
    ):
        # No compose plugin on this machine: the structural checks above are the test.
        return
    env = tmp_path / ".env"
    env.write_text("\n".join(f"{k}=x" for k in sorted(ENV_EXAMPLE)))
    result = subprocess.run(
        [
            docker,
            "compose",
            "-f",
            str(ROOT / "docker-compose.yml"),
            "--env-file",
            str(env),
            "config",
            "--quiet",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
