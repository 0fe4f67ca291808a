"""Redis for the shared-limits tests: the suite's own (``REDIS_URL``, else 127.0.0.1:6379) for
tests that only read and write their own keys, and a ``redis-server`` of a test's own, on a
free port, for tests that kill, pause, slow or flush it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
import redis

from common.supervisor import free_port


def suite_redis_url() -> str:
    """The suite's Redis; a test that needs it is skipped, saying why, when none answers."""
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {url} ({exc}): the shared limits need one")
    return url


class OwnRedis:
    """A ``redis-server`` of the test's own, without persistence, that it may stop and start
    again on the same port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed: the Redis failure tests start their own")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=5)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                *(self.binary, "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--enable-debug-command", "local"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
        self.kill()
