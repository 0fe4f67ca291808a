"""``syshax web`` on the real gunicorn: slow clients hold no thread (controlplane/webworker.py).

The server runs as the stack runs it (2 workers x 4 threads) against the test database, with
a 2 s read timeout. 40 slow bodies and 40 slow heads hold on while health is asked again and
again; real agent heartbeats with a body still work, on a kept-alive connection too.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from controlplane.access.models import MachineCredential
from controlplane.inventory.models import Heartbeat, Node
from controlplane.webworker import (
    MAX_HEAD_BYTES,
    Extent,
    ReadLimits,
    error_answer,
    limits_from_env,
    request_extent,
)
from testbed import slow_clients as slow
from tests.support.controlplane import child_env, free_port, running, syshax, wait_until

READ_TIMEOUT = 2.0
LIMITS = {"max_head": MAX_HEAD_BYTES, "max_body": 1024}


def extent(raw: bytes) -> Extent:
    return request_extent(raw, **LIMITS)


# -- where a request ends, from its head --------------------------------------------------------


def test_a_head_without_a_body_is_whole_at_its_empty_line() -> None:
    assert extent(b"GET / HTTP/1.1\r\nHost: a\r\n") == Extent()
    head = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    assert extent(head) == Extent(total=len(head))
    # RFC 9112 2.2: an empty line before the request line is not the end of a head.
    assert extent(b"\r\nGET / HTTP/1.1\r\n") == Extent()


def test_a_body_is_whole_at_its_content_length() -> None:
    head = b"POST / HTTP/1.1\r\ncontent-LENGTH: 5\r\nExpect: 100-Continue\r\n\r\n"
    assert extent(head + b"he") == Extent(total=len(head) + 5, expects_continue=True)
    assert extent(head + b"hello" + b"GET").total == len(head) + 5


def test_what_the_worker_answers_itself() -> None:
    def refused(raw: bytes) -> int:
        return extent(raw).refuse

    assert refused(b"POST / HTTP/1.1\r\nContent-Length: 1025\r\n\r\n") == 413
    assert refused(b"POST / HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n") == 413
    assert refused(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n") == 411
    assert refused(b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n") == 400
    assert refused(b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n") == 400
    assert refused(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES) == 431
    answer = error_answer(408, "too slow")
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
        "error": {"code": "request_timeout", "message": "too slow"}
    }


def test_a_head_gunicorn_refuses_is_handed_over_as_soon_as_it_is_whole() -> None:
    # A bare LF: gunicorn answers 400 from the head alone, so the body is not waited for.
    head = b"POST / HTTP/1.1\nContent-Length: 5\n\n"
    assert extent(head) == Extent(total=len(head))


def test_a_bad_limit_names_its_variable() -> None:
    assert limits_from_env({}).timeout == 10.0
    assert limits_from_env({"SYSHAX_WEB_READ_TIMEOUT": "2.5"}).timeout == 2.5
    with pytest.raises(ValueError, match="SYSHAX_WEB_READ_TIMEOUT='soon'"):
        limits_from_env({"SYSHAX_WEB_READ_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="SYSHAX_WEB_READ_TIMEOUT='0'"):
        limits_from_env({"SYSHAX_WEB_READ_TIMEOUT": "0"})
    with pytest.raises(ValueError, match="MAX_REQUEST_BODY_BYTES='1k'"):
        limits_from_env({"MAX_REQUEST_BODY_BYTES": "1k"})
    with pytest.raises(ValueError, match="BATCH_MAX_FILE_BYTES='50M'"):
        limits_from_env({"BATCH_MAX_FILE_BYTES": "50M"})


def test_the_batch_upload_path_alone_takes_a_file_sized_body(settings) -> None:
    limits = limits_from_env({"BATCH_MAX_FILE_BYTES": str(4 * 1024 * 1024)})
    assert limits.by_path == {b"/v1/files": 5 * 1024 * 1024}
    # The settings the control plane answers with say the same, from the same defaults.
    assert ReadLimits().by_path == {p.encode(): n for p, n in settings.BODY_LIMITS_BY_PATH.items()}
    assert ReadLimits().max_file == settings.BATCH_MAX_FILE_BYTES

    def refused(target: str, length: int) -> int:
        raw = f"POST {target} HTTP/1.1\r\nContent-Length: {length}\r\n\r\n".encode()
        return request_extent(
            raw, max_head=MAX_HEAD_BYTES, max_body=1024, by_path=limits.by_path
        ).refuse

    big = 3 * 1024 * 1024
    assert refused("/v1/files", big) == 0
    assert refused("/v1/files?purpose=batch", big) == 0
    assert refused("/v1/files", 5 * 1024 * 1024 + 1) == 413
    for elsewhere in ("/v1/files/", "/v1/files/file-1", "/v1/filesx", "/api/v1/health"):
        assert refused(elsewhere, big) == 413, elsewhere


# -- the real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[int]:
    """``syshax web`` on the test database; yields its port."""
    port = free_port()
    argv = syshax(
        "web", "--bind", f"127.0.0.1:{port}", "--no-migrate", "--read-timeout", str(READ_TIMEOUT)
    )
    log = tmp_path_factory.mktemp("web") / "web.log"
    with django_db_blocker.unblock(), running(argv, log):
        wait_until(lambda: slow.health_answers(port), 60, "syshax web to answer health")
        yield port
    assert "Traceback" not in log.read_text(), log.read_text()


def exchange(port: int, *parts: bytes, pause: float = 0.0) -> tuple[float, bytes]:
    """Send ``parts`` with ``pause`` between them; the answer and how long it took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for index, part in enumerate(parts):
            if index:
                time.sleep(pause)
            sock.sendall(part)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return time.monotonic() - started, answer


@pytest.mark.process
def test_health_answers_while_80_slow_clients_hold_on_and_each_gets_a_408(web: int) -> None:
    seconds = 7.0
    figures = slow.attack(web, slow_bodies=40, slow_heads=40, seconds=seconds, interval=0.5)
    assert len(figures.probes) >= 10
    assert None not in figures.probes, figures.probes
    assert max(figures.answered) < 3.0, figures.probes
    # Every slow connection opened long enough before the end was closed at its deadline.
    end = min(h.opened for h in figures.held) + seconds
    due = [h for h in figures.held if h.opened < end - READ_TIMEOUT - 2.0]
    assert len(due) >= 80
    held_for = [h.seconds for h in due]
    assert all(s is not None and READ_TIMEOUT - 0.1 < s < READ_TIMEOUT + 2.0 for s in held_for)
    assert {h.status for h in due} <= {408, None}
    assert sum(h.status == 408 for h in due) >= 0.9 * len(due)


@pytest.mark.django_db(transaction=True)
def test_agent_heartbeats_with_a_body_work_on_a_kept_alive_connection(web: int) -> None:
    node = Node.objects.create(name="slow-clients-node", address="127.0.0.1")
    token = MachineCredential.issue("agent", "agent-slow", node=node)[1]
    body = json.dumps({"cpu_percent": 12.5, "memory_used_bytes": 1, "memory_total_bytes": 2})
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", web, timeout=10)
    try:
        sockets = []
        for _ in range(3):
            conn.request("POST", f"/api/v1/nodes/{node.pk}/heartbeat", body, headers)
            answer = conn.getresponse()
            assert answer.status == 200, answer.read()
            assert json.loads(answer.read())["status"] == "online"
            sockets.append(conn.sock)
        assert sockets[0] is not None and sockets.count(sockets[0]) == 3  # one connection
    finally:
        conn.close()

    head = (
        f"POST /api/v1/nodes/{node.pk}/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    ).encode()
    # A body that comes in pieces, but whole within the read timeout.
    took, answer = exchange(web, head + b"\r\n" + body[:10].encode(), body[10:].encode(), pause=1)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert took >= 1.0

    # Expect: 100-continue gets its interim answer before the body is sent, and only one.
    with socket.create_connection(("127.0.0.1", web), timeout=10) as sock:
        sock.sendall(head + b"Expect: 100-continue\r\n\r\n")
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body.encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert Heartbeat.objects.filter(node=node).count() == 5


def test_an_oversized_or_chunked_body_is_refused_before_it_is_read(web: int) -> None:
    head = "POST /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    took, answer = exchange(web, f"{head}Content-Length: {3 * 1024 * 1024}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert b'"payload_too_large"' in answer
    assert took < 1.5
    _, answer = exchange(web, f"{head}Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 411 "), answer


@pytest.mark.django_db(transaction=True)
def test_a_3_mib_batch_upload_is_stored_through_syshax_web(web: int) -> None:
    from controlplane.batches.models import BatchFile
    from controlplane.tenants.models import Tenant
    from controlplane.tenants.services import issue_key

    _, key = issue_key(Tenant.objects.create(name="uploads"), acting_user=None)
    content = b'{"custom_id": "a"}\n' * (3 * 1024 * 1024 // 19 + 1)
    boundary = "syshax-upload-boundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": f"multipart/form-data; boundary={boundary}",
    }
    conn = http.client.HTTPConnection("127.0.0.1", web, timeout=30)
    try:
        conn.request("POST", "/v1/files", body, headers)
        answer = conn.getresponse()
        data = answer.read()
    finally:
        conn.close()
    assert answer.status == 200, data
    created = json.loads(data)
    assert created["bytes"] == len(content) > 3 * 1024 * 1024
    assert BatchFile.objects.get(pk=created["id"]).chunks.count() == 4


def test_a_request_left_unfinished_behind_a_kept_alive_one_gets_a_408(web: int) -> None:
    request = b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    took, answer = exchange(web, request + b"GET /api/v1/hea")
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert answer.count(b"HTTP/1.1 ") == 2
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert READ_TIMEOUT - 0.1 < took < READ_TIMEOUT + 2.0


@pytest.mark.process
def test_syshax_web_refuses_a_bad_read_timeout_naming_it() -> None:
    result = subprocess.run(
        syshax("web", "--no-migrate"),
        env=child_env(SYSHAX_WEB_READ_TIMEOUT="soon"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "SYSHAX_WEB_READ_TIMEOUT='soon' is not a number of seconds" in result.stderr
