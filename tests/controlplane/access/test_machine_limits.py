"""Machine credentials are rate-limited; people are not; the API never shows an HTML page."""

from __future__ import annotations

import pytest
from django.test import override_settings
from rest_framework.throttling import SimpleRateThrottle


@pytest.fixture
def five_a_minute(monkeypatch):
    monkeypatch.setattr(SimpleRateThrottle, "THROTTLE_RATES", {"machine": "5/m"})


def test_a_machine_credential_over_its_rate_gets_429_with_retry_after(
    agent_client, node, admin_client, five_a_minute
) -> None:
    answers = [
        agent_client.post(f"/api/v1/nodes/{node.pk}/heartbeat/", {}, format="json")
        for _ in range(7)
    ]
    assert [a.status_code for a in answers] == [200] * 5 + [429, 429]
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "throttled"
    assert 0 < int(refused["Retry-After"]) <= 60
    # People are not counted; another machine has its own count.
    assert all(admin_client.get("/api/v1/nodes/").status_code == 200 for _ in range(7))


def test_the_limit_is_per_credential(
    agent_client, other_agent_client, node, other_node, five_a_minute
) -> None:
    for _ in range(5):
        agent_client.post(f"/api/v1/nodes/{node.pk}/heartbeat/", {}, format="json")
    assert agent_client.get("/api/v1/agent/self").status_code == 429
    assert other_agent_client.get("/api/v1/agent/self").status_code == 200


def test_api_errors_are_json_even_for_unknown_paths_and_crashes(admin_client, monkeypatch) -> None:
    missing = admin_client.get("/api/v1/no-such-thing/")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    from controlplane.inventory.api import views

    def boom(*args, **kwargs):
        raise RuntimeError("secret detail that must not reach a client")

    monkeypatch.setattr(views.NodeViewSet, "list", boom)
    admin_client.raise_request_exception = False
    with override_settings(DEBUG=True):
        crashed = admin_client.get("/api/v1/nodes/")
    assert crashed.status_code == 500
    assert crashed["Content-Type"] == "application/json"
    assert "secret detail" not in crashed.content.decode()
    assert crashed.json()["error"]["code"] == "server_error"


def test_every_page_has_a_content_security_policy(admin_client) -> None:
    policy = admin_client.get("/api/v1/health")["Content-Security-Policy"]
    assert "script-src 'self';" in policy and "frame-ancestors 'none'" in policy
    assert "cdn.jsdelivr.net" in admin_client.get("/api/v1/docs/")["Content-Security-Policy"]


def test_error_reports_hide_urls_with_credentials() -> None:
    from controlplane.core.middleware import SecretSettingsFilter

    cleansed = SecretSettingsFilter().get_safe_settings()
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "SECRET_KEY"):
        assert cleansed[name] == SecretSettingsFilter.cleansed_substitute


def test_profile_env_values_are_shown_only_to_people_who_may_change_profiles(
    user_client, operator_client, make_profile
) -> None:
    profile = make_profile(gpu_env={"HF_TOKEN": "hf_secret"}, cpu_env={"A": "b"})
    viewer = user_client.get(f"/api/v1/profiles/{profile.pk}/").json()
    assert viewer["gpu_env"] == {"HF_TOKEN": "<hidden>"} and viewer["cpu_env"] == {"A": "<hidden>"}
    assert "hf_secret" not in user_client.get("/api/v1/profiles/").content.decode()
    editor = operator_client.get(f"/api/v1/profiles/{profile.pk}/").json()
    assert editor["gpu_env"] == {"HF_TOKEN": "hf_secret"}


@pytest.mark.process
def test_the_state_directory_and_the_sqlite_file_are_private(tmp_path) -> None:
    import subprocess
    import sys

    var = tmp_path / "state"
    env = {
        "PATH": "/usr/bin:/bin",
        "SYSHAX_VAR_DIR": str(var),
        "SYSHAX_ENV_FILE": str(tmp_path / "none.env"),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
    }
    code = (
        "import django; django.setup(); from django.db import connection; "
        "connection.ensure_connection()"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert oct(var.stat().st_mode & 0o777) == "0o700"
    assert oct((var / "controlplane.sqlite3").stat().st_mode & 0o777) == "0o600"


def test_a_benchmark_targets_only_this_fleets_routers_and_engines(
    admin_client, settings, make_deployment, router_token
) -> None:
    settings.BENCHMARK_ALLOWED_TARGETS = []

    def post(url: str):
        body = {"scenario": "short", "target_url": url, "concurrency": 1, "iterations": 1}
        return admin_client.post("/api/v1/benchmark-runs/", body, format="json")

    refused = post("http://169.254.169.254:80/latest/meta-data")
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "target_url: 169.254.169.254:80 is neither a configured router (ROUTER_URLS) nor a "
        "deployment's engine; an operator can allow it in BENCHMARK_ALLOWED_TARGETS"
    )
    assert post("http://127.0.0.1:6379/").status_code == 400  # e.g. the broker itself
    deployment = make_deployment()  # its node's address is 127.0.0.1
    assert post(f"http://localhost:{deployment.profile.gpu_port}").status_code == 201
    from rest_framework.test import APIClient

    router = APIClient()
    router.credentials(HTTP_AUTHORIZATION=f"Bearer {router_token}")
    registered = router.post(
        "/api/v1/routers/register",
        {"name": "r1", "listen_url": "http://10.9.0.4:7010"},
        format="json",
    )
    assert registered.status_code == 200, registered.content
    # A reported address is not trusted (decision 56): only a configured router is a target.
    assert post("http://10.9.0.4:7010").status_code == 400
    settings.ROUTER_URLS = ["http://10.9.0.4:7010"]
    assert post("http://10.9.0.4:7010").status_code == 201
    assert post("http://10.9.0.4:7011").status_code == 400
    settings.BENCHMARK_ALLOWED_TARGETS = ["bench.example:8080"]
    assert post("http://bench.example:8080/v1").status_code == 201


def test_a_form_body_past_the_field_limit_is_a_400_naming_the_limit(agent_client, node) -> None:
    # Django refuses more than DATA_UPLOAD_MAX_NUMBER_FIELDS form fields while DRF parses the
    # body; that is the client's error, answered in the API's shape, never a server error.
    body = "&".join(f"f{i}=1" for i in range(1200))
    agent_client.raise_request_exception = False
    answer = agent_client.put(
        f"/api/v1/nodes/{node.pk}/inventory/",
        body,
        content_type="application/x-www-form-urlencoded",
    )
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "parse_error"
    assert "1000" in error["message"] and "fields" in error["message"]


def test_a_request_is_counted_in_one_cache_round_trip(monkeypatch) -> None:
    from django.core.cache import caches
    from django.core.cache.backends.redis import RedisCache

    from controlplane.access import throttling

    key = "throttle-machine-round-trips"
    if not isinstance(caches["default"], RedisCache):
        # The in-memory cache (embedded defaults): counted all the same, no network.
        assert [throttling._count(key, 60) for _ in range(3)] == [1, 2, 3]
        return
    import redis.connection

    sent: list[object] = []
    real = redis.connection.Connection.send_packed_command

    def counting(self, command, check_health=True):  # type: ignore[no-untyped-def]
        sent.append(command)
        return real(self, command, check_health)

    throttling._count(key, 60)  # the connection is opened outside the count
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
    assert [throttling._count(key, 60) for _ in range(3)] == [2, 3, 4]
    assert len(sent) == 3  # INCR and EXPIRE NX leave in one write each time
    assert 0 < throttling._seconds_left(key, 60) <= 60
