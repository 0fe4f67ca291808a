"""`syshax up` (what `make up` runs) brings the whole system up on the embedded defaults,
serves a completion through the router from the hetero deployment, and stops cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

from common.supervisor import free_port
from syshax.commands.up_stack import SIM_MODEL

ROOT = Path(__file__).resolve().parents[2]


def processes_mentioning(text: str) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if text in cmdline and process.pid != os.getpid():
            found.append(f"{process.pid}: {cmdline[:120]}")
    return found


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def up_command(tmp_path: Path, *args: str) -> tuple[list[str], dict[str, str], list[str]]:
    """``syshax up --exit`` on free ports and the embedded defaults under ``tmp_path``:
    (argv, environment, the five ports: web, router, both engines, the machine gateway)."""
    ports = [str(free_port()) for _ in range(5)]
    env = {
        **os.environ,
        "SYSHAX_VAR_DIR": str(tmp_path / "var"),
        "SYSHAX_ENV_FILE": str(tmp_path / "none.env"),
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "CELERY_BROKER_URL": "",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
    }
    argv = [sys.executable, "-m", "syshax.cli", "up", *args, "--exit"]
    flags = ("--port", "--router-port", "--gpu-port", "--cpu-port", "--gateway-port")
    for flag, port in zip(flags, ports, strict=True):
        argv += [flag, port]
    return argv, env, ports


# Machine tokens, people's API tokens and the router's API key.
SECRET_PREFIXES = ("sxa_", "sxr_", "sxp_", "sxk_")


@contextlib.contextmanager
def watching_command_lines() -> Iterator[list[str]]:
    """While the block runs, every process whose command line holds a secret, by its prefix."""
    exposed: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            for prefix in SECRET_PREFIXES:
                exposed.extend(processes_mentioning(prefix))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield exposed
    finally:
        done.set()
        watcher.join()


def batch_of_3_mib_runs(router: str, key: str) -> None:
    """A 3 MiB batch input file uploads through the router (router, gateway, web) and its
    batch runs: two lines go to the engines; the rest, padded to 3 MiB, name another endpoint
    and fail at validation, so the test takes seconds, not the minutes 3 MiB of prompts do."""
    headers = {"Authorization": f"Bearer {key}"}
    good = [
        {
            "custom_id": f"ok-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": SIM_MODEL, "prompt": "Hello", "max_tokens": 2},
        }
        for i in range(2)
    ]
    lines = [json.dumps(line) for line in good]
    pad = "x" * 2000
    while sum(len(line) + 1 for line in lines) < 3 * 1024 * 1024:
        lines.append(
            json.dumps(
                {
                    "custom_id": f"pad-{len(lines)}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"model": SIM_MODEL, "input": pad},
                }
            )
        )
    content = ("\n".join(lines) + "\n").encode()
    uploaded = httpx.post(
        f"{router}/v1/files",
        headers=headers,
        files={"file": ("big.jsonl", content, "application/jsonl")},
        data={"purpose": "batch"},
        timeout=120,
    )
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json()["bytes"] == len(content) > 3 * 1024 * 1024
    created = httpx.post(
        f"{router}/v1/batches",
        headers=headers,
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
        timeout=30,
    )
    assert created.status_code == 200, created.text
    deadline = time.monotonic() + 180
    while True:
        batch = httpx.get(
            f"{router}/v1/batches/{created.json()['id']}", headers=headers, timeout=30
        ).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            break
        assert time.monotonic() < deadline, batch
        time.sleep(1)
    counts = batch["request_counts"]
    assert batch["status"] == "completed", batch
    assert (counts["total"], counts["completed"]) == (len(lines), 2), counts
    output = httpx.get(
        f"{router}/v1/files/{batch['output_file_id']}/content", headers=headers, timeout=60
    )
    answers = [json.loads(line) for line in output.content.splitlines()]
    assert {a["custom_id"] for a in answers} == {"ok-0", "ok-1"}
    assert all(a["response"]["status_code"] == 200 for a in answers)


def playground_answers(web: str, password: str) -> None:
    """The dashboard's playground, signed in as the admin, answers through the real router."""
    with httpx.Client(base_url=web, follow_redirects=True, timeout=60) as client:
        client.get("/accounts/login/")
        signed_in = client.post(
            "/accounts/login/",
            data={
                "username": "admin",
                "password": password,
                "csrfmiddlewaretoken": client.cookies["csrftoken"],
            },
            headers={"Referer": f"{web}/accounts/login/"},
        )
        assert signed_in.status_code == 200 and "/accounts/login/" not in str(signed_in.url)
        pk = client.get("/api/v1/deployments/").json()["results"][0]["id"]
        client.get(f"/deployments/{pk}/")
        answer = client.post(
            f"/deployments/{pk}/playground/",
            data={
                "play-prompt": "Say hello",
                "play-max_tokens": "4",
                "play-mode": "auto",
                "csrfmiddlewaretoken": client.cookies["csrftoken"],
            },
            headers={"Accept": "application/json", "Referer": f"{web}/deployments/{pk}/"},
        )
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert result["ok"] is True and result["status"] == 200, result
        assert result["completion_tokens"] == 4 and result["router"], result


def serve_until_interrupted(
    argv: list[str],
    env: dict[str, str],
    router: str,
    key: str,
    gateway: str = "",
    web: str = "",
    password: str = "",
) -> tuple[int, str]:
    """Run ``syshax up`` (no --exit); once it serves, check the router's API key from outside:
    refused without it or with a wrong one (OpenAI's 401), served with it, and that the agent
    and the router talk to ``gateway``; with ``web``, that a 3 MiB batch file uploads and runs
    through the router and that the playground answers. Then Ctrl-C."""
    process = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    serving = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "Ctrl-C stops everything." in line:
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 400
        while not serving.wait(1):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        if gateway:  # the machines' endpoint is the gateway, not web
            machines = processes_mentioning(f"--control-plane {gateway}")
            assert len(machines) == 2 and any(" agent " in m for m in machines), machines
            assert httpx.get(f"{gateway}/api/v1/health", timeout=10).status_code == 200
        request = {"model": SIM_MODEL, "prompt": "Hello", "max_tokens": 4}
        url = f"{router}/v1/completions"
        for headers in ({}, {"Authorization": "Bearer sxk_wrong"}):
            refused = httpx.post(url, json=request, headers=headers, timeout=30)
            assert refused.status_code == 401, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        served = httpx.post(
            url, json=request, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4
        if web:
            batch_of_3_mib_runs(router, key)
            playground_answers(web, password)
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=10)
    return status, "".join(lines)


def test_up_serves_a_completion_from_the_hetero_deployment_and_stops_cleanly(tmp_path) -> None:
    var_dir = tmp_path / "var"
    argv, env, ports = up_command(tmp_path)
    # While it runs, no process may carry a token or key on its command line.
    with watching_command_lines() as exposed:
        result = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
        )
    assert exposed == []
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "start-gpu: GPU engine" in output and "start-cpu: CPU engine" in output
    assert output.index("start-gpu:") < output.index("start-cpu:")
    assert "router refuses a request without its API key (401)" in output
    assert "completion through the router:" in output
    assert "admin user admin / " in output
    password = output.split("admin user admin / ", 1)[1].split()[0]
    key = json.loads((var_dir / "up" / "tokens.json").read_text())["router_api_key"]
    assert f"router key {key}" in output  # shown at the first start
    assert "stopped." in output
    assert processes_mentioning(str(var_dir)) == []
    for port in ports:  # web, router, both engines and the gateway are gone
        assert not listening(int(port)), f"port {port} still served after shutdown"
    # A second run reuses the state (no new admin password or router key, same node) and
    # serves until Ctrl-C.
    serve = [arg for arg in argv if arg != "--exit"]
    with watching_command_lines() as exposed:
        status, again = serve_until_interrupted(
            serve,
            env,
            f"http://127.0.0.1:{ports[1]}",
            key,
            f"http://127.0.0.1:{ports[4]}",
            f"http://127.0.0.1:{ports[0]}",
            password,
        )
    assert exposed == []
    assert status == 0, again[-4000:]
    assert "admin user admin / " not in again and key not in again
    assert "stopped." in again
    assert processes_mentioning(str(var_dir)) == []
