from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.settings.env import (
    ImproperlyConfiguredEnv,
    env_bool,
    env_int,
    load_env_file,
    parse_database_url,
)
from syshax.cli import main as syshax_main

ROOT = Path(__file__).resolve().parents[3]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


@pytest.mark.process
def test_production_refuses_to_start_without_a_secret_key(tmp_path) -> None:
    result = run_python(
        "import django; django.setup()",
        DJANGO_SETTINGS_MODULE="controlplane.settings.production",
        SECRET_KEY="",
        SYSHAX_VAR_DIR=str(tmp_path),
        SYSHAX_ENV_FILE=str(tmp_path / "none"),
    )
    assert result.returncode != 0
    assert "SECRET_KEY (or SECRET_KEY_FILE) must be set" in result.stderr


@pytest.mark.process
def test_a_web_worker_loads_its_urls_and_task_modules_before_its_first_request(
    tmp_path,
) -> None:
    """What gunicorn's worker imports: after it, no request imports the views or the tasks
    (a deploy once paid a second of imports,
    docs/decisions/0036-group-commits-one-statement.md)."""
    code = (
        "import sys, controlplane.wsgi; from celery import current_app;"
        "print('deployments.expire_stale_commands' in current_app.tasks,"
        " 'controlplane.deployments.api.views' in sys.modules,"
        " 'controlplane.benchmarks.tasks' in sys.modules)"
    )
    result = run_python(code, SYSHAX_VAR_DIR=str(tmp_path), SYSHAX_ENV_FILE=str(tmp_path / "n"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True"]


@pytest.mark.process
def test_the_local_secret_is_generated_once_into_var(tmp_path) -> None:
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    env = {
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
        "SECRET_KEY": "",
        "SYSHAX_VAR_DIR": str(tmp_path),
        "SYSHAX_ENV_FILE": str(tmp_path / "none"),
    }
    first, second = run_python(code, **env), run_python(code, **env)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert (tmp_path / "secret_key").read_text().strip() == first.stdout.strip()
    assert oct((tmp_path / "secret_key").stat().st_mode & 0o777) == "0o600"


def test_bad_environment_values_name_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("HEARTBEAT_TOLERANCE", "lots")
    with pytest.raises(
        ImproperlyConfiguredEnv, match="HEARTBEAT_TOLERANCE='lots' is not an integer"
    ):
        env_int("HEARTBEAT_TOLERANCE", 3)
    monkeypatch.setenv("DEBUG", "perhaps")
    with pytest.raises(ImproperlyConfiguredEnv, match="DEBUG='perhaps' is not a boolean"):
        env_bool("DEBUG", False)
    with pytest.raises(ImproperlyConfiguredEnv, match="unsupported scheme 'mysql'"):
        parse_database_url("mysql://x/y", base_dir=ROOT)


def test_database_urls(tmp_path) -> None:
    pg = parse_database_url("postgres://u:p%40ss@db:5433/cp", base_dir=ROOT)
    assert (pg["ENGINE"], pg["NAME"], pg["USER"], pg["PASSWORD"], pg["HOST"], pg["PORT"]) == (
        "django.db.backends.postgresql",
        "cp",
        "u",
        "p@ss",
        "db",
        "5433",
    )
    assert parse_database_url("sqlite:///var/x.db", base_dir=tmp_path)["NAME"] == str(
        tmp_path / "var/x.db"
    )
    assert parse_database_url(f"sqlite:///{tmp_path}/y.db", base_dir=ROOT)["NAME"] == str(
        tmp_path / "y.db"
    )


def test_secret_files_and_env_files(tmp_path, monkeypatch) -> None:
    (tmp_path / "pw").write_text("from-file\n")
    monkeypatch.setenv("DB_PASSWORD_FILE", str(tmp_path / "pw"))
    from controlplane.settings.env import env_str

    assert env_str("DB_PASSWORD") == "from-file"
    (tmp_path / "syshax.env").write_text("# comment\nSYSHAX_T1=one\nSYSHAX_T2='two'\n")
    monkeypatch.setenv("SYSHAX_T2", "kept")
    load_env_file(tmp_path / "syshax.env")
    assert (os.environ["SYSHAX_T1"], os.environ["SYSHAX_T2"]) == ("one", "kept")
    monkeypatch.delenv("SYSHAX_T1")
    (tmp_path / "bad.env").write_text("not a pair\n")
    with pytest.raises(ImproperlyConfiguredEnv, match=r"bad\.env:1: expected KEY=VALUE"):
        load_env_file(tmp_path / "bad.env")


def test_oversized_bodies_get_a_json_413(admin_client, settings) -> None:
    settings.MAX_REQUEST_BODY_BYTES = 2048
    response = admin_client.post("/api/v1/scenarios/", {"name": "x" * 4000}, format="json")
    assert response.status_code == 413
    assert response["Content-Type"] == "application/json"
    assert "the limit is 2048 bytes" in response.json()["error"]["message"]


def test_health_is_public_and_checks_the_database(db, anonymous_client) -> None:
    response = anonymous_client.get("/api/v1/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}


def test_syshax_config_shows_and_changes_the_policy(db, capsys) -> None:
    assert syshax_main(["config", "auto_pd_offload", "false"]) == 0
    assert (
        "enable_auto_pd_offload = False (policy default is now version 2)"
        in capsys.readouterr().out
    )
    # sysHAX's documented `config cpu_max_batch_size 8` sets the default again: a no-op.
    assert syshax_main(["config", "cpu_max_batch_size", "8"]) == 0
    assert "cpu_max_batch_size is already 8 (policy default stays at version 2)" in (
        capsys.readouterr().out
    )
    assert syshax_main(["config", "cpu_max_batch_size", "lots"]) == 2
    assert "cpu_max_batch_size: must be an integer, got 'lots'" in capsys.readouterr().err
    assert syshax_main(["config"]) == 0
    out = capsys.readouterr().out
    assert "policy default version 2" in out
    assert "enable_auto_pd_offload    false" in out
    from controlplane.policy.models import PolicyRevision

    revision = PolicyRevision.objects.get(version=2)
    assert revision.created_by_label.startswith("cli:")
    assert revision.reason == "syshax config auto_pd_offload false"


def test_unknown_subcommand_is_a_clear_error(capsys) -> None:
    assert syshax_main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
