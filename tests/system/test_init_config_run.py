"""sysHAX's operator path in a fresh directory: ``syshax init``, ``syshax config``, ``syshax run``.

Every command runs as a user runs it: the console entry point in a child process, in a new
empty directory, with none of the test suite's settings in its environment (embedded SQLite
under that directory). The router ``syshax run`` starts serves a completion from a real
simulator through the ``openai`` client, and picks up a ``syshax config`` change while it runs.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.supervisor import ReadyChild, free_port, python_argv, wait_until

ROOT = Path(__file__).resolve().parents[2]
# The suite's own settings would point the commands at the test database and broker.
SUITE_VARS = (
    "SYSHAX_VAR_DIR",
    "SYSHAX_ENV_FILE",
    "DATABASE_URL",
    "REDIS_URL",
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
    "DJANGO_SETTINGS_MODULE",
    "SYSHAX_TEST_BACKENDS",
)


def user_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in SUITE_VARS and not k.startswith("SYSHAX_")
    }
    return {**env, **extra}


def syshax(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_argv(*args),
        cwd=cwd,
        env=env or user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory where `syshax init` ran."""
    directory = tmp_path_factory.mktemp("operator")
    result = syshax(directory, "init")
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "database ready" in result.stdout
    return directory


def test_a_verb_before_init_says_what_to_run_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty-var"
    empty.mkdir()
    result = syshax(
        tmp_path, "config", "auto_pd_offload", "true", env=user_env(SYSHAX_VAR_DIR=str(empty))
    )
    assert result.returncode == 1
    assert "run 'syshax init' first" in one_line_error(result)
    result = syshax(tmp_path, "run")
    assert result.returncode == 2
    assert "no configuration at" in one_line_error(result)
    assert "run 'syshax init' first" in result.stderr


def test_init_writes_a_private_env_file_a_database_and_the_policy_file(home: Path) -> None:
    env_file = home / "syshax.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    text = env_file.read_text()
    assert f"SYSHAX_VAR_DIR={home / 'var'}" in text
    # sysHAX's example ports
    for line in (
        "SYSHAX_GPU_URL=http://127.0.0.1:7001",
        "SYSHAX_CPU_URL=http://127.0.0.1:7002",
        "SYSHAX_ROUTER_PORT=7010",
    ):
        assert line in text
    assert (home / "var" / "controlplane.sqlite3").is_file()
    policy = json.loads((home / "var" / "policy.json").read_text())
    assert policy["name"] == "default" and policy["knobs"]["cpu_max_batch_size"] == 8
    again = syshax(home, "init")
    assert again.returncode == 0 and "keeping it" in again.stdout
    assert env_file.read_text() == text


def test_the_documented_config_sequence_succeeds_and_changes_the_policy(home: Path) -> None:
    # The documents' own lines: both set knobs to the defaults, which is not an error.
    for knob, value in (("auto_pd_offload", "true"), ("cpu_max_batch_size", "8")):
        result = syshax(home, "config", knob, value)
        assert result.returncode == 0, result.stderr
        assert "already" in result.stdout
    result = syshax(home, "config", "cpu_max_batch_size", "4")
    assert result.returncode == 0, result.stderr
    assert "is now version 2" in result.stdout
    assert (
        json.loads((home / "var" / "policy.json").read_text())["knobs"]["cpu_max_batch_size"] == 4
    )
    shown = syshax(home, "config")
    assert "policy default version 2" in shown.stdout
    assert "gpu_url" in shown.stdout and "http://127.0.0.1:7001" in shown.stdout


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("gpu_url", "localhost:7001", "gpu_url must be an http(s)://HOST:PORT URL"),
        ("router_port", "70100", "router_port must be a port number 1-65535"),
        ("pd_protocol", "nixl", "pd_protocol must be one of vllm, syshax"),
        ("cpu_max_batch_size", "lots", "cpu_max_batch_size: must be an integer"),
        ("no_such_knob", "1", "no_such_knob"),
    ],
)
def test_bad_config_values_are_refused_naming_the_key(
    home: Path, key: str, value: str, message: str
) -> None:
    before = (home / "syshax.env").read_text()
    result = syshax(home, "config", key, value)
    assert result.returncode == 2
    assert message in one_line_error(result)
    assert (home / "syshax.env").read_text() == before


def test_run_refuses_a_broken_file_naming_the_key_and_the_file(tmp_path: Path) -> None:
    result = syshax(tmp_path, "init")
    assert result.returncode == 0, result.stderr
    env_file = tmp_path / "syshax.env"
    env_file.write_text(
        env_file.read_text().replace("SYSHAX_ROUTER_PORT=7010", "SYSHAX_ROUTER_PORT=x")
    )
    result = syshax(tmp_path, "run")
    assert result.returncode == 2
    line = one_line_error(result)
    assert "router_port" in line and f"SYSHAX_ROUTER_PORT in {env_file}" in line
    env_file.write_text(
        env_file.read_text().replace("SYSHAX_ROUTER_PORT=x", "SYSHAX_ROUTER_PORT=7010")
        + "SYSHAX_CONTROL_PLANE_URL=http://127.0.0.1:8000\n"
    )
    result = syshax(tmp_path, "run")
    assert result.returncode == 2
    assert "router_token is not" in one_line_error(result)


def test_run_is_managed_when_a_control_plane_and_token_are_configured(tmp_path: Path) -> None:
    assert syshax(tmp_path, "init").returncode == 0
    assert syshax(tmp_path, "config", "control_plane_url", "http://10.0.0.5:8000").returncode == 0
    assert syshax(tmp_path, "config", "router_token", "sxr_secret_token_value").returncode == 0
    result = syshax(tmp_path, "run", "--print")
    assert result.returncode == 0, result.stderr
    assert "--control-plane http://10.0.0.5:8000" in result.stdout
    assert "--gpu-url" not in result.stdout
    assert "sxr_secret_token_value" not in result.stdout  # the token travels in the environment


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[ReadyChild]:
    sim = ReadyChild(
        "gpu",
        python_argv(
            "sim",
            "--device",
            "a100-80gb",
            "--model",
            "qwen2.5-7b-instruct",
            "--served-model-name",
            "tiny",
            "--speed",
            "20",
        ),
        tmp_path,
        cwd=ROOT,
        timeout=30,
    )
    try:
        yield sim
    finally:
        sim.stop()


def test_run_serves_completions_and_follows_config_changes_live(
    home: Path, engine: ReadyChild
) -> None:
    port = free_port()
    for key, value in (("gpu_url", engine.url), ("cpu_url", ""), ("router_port", str(port))):
        result = syshax(home, "config", key, value)
        assert result.returncode == 0, result.stderr
    log = (home / "run.log").open("w")
    router = subprocess.Popen(
        python_argv("run"), cwd=home, env=user_env(), stdout=log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"

    def health() -> dict[str, object] | None:
        assert router.poll() is None, (home / "run.log").read_text()
        try:
            response = httpx.get(base + "/health", timeout=2)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    try:
        first = wait_until(health, 60, "syshax run's router")
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="tiny", prompt="hello there", max_tokens=8)
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        assert completion.choices[0].text
        # A knob changed in another shell reaches the running router through policy.json.
        result = syshax(home, "config", "auto_pd_offload", "false")
        assert result.returncode == 0, result.stderr
        changed = wait_until(
            lambda: (h := health()) and h["policy_version"] != first["policy_version"] and h,
            10,
            "the router to apply the new policy",
        )
        assert changed["policy_version"] == first["policy_version"] + 1  # type: ignore[operator]
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=15)
        log.close()
