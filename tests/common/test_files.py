"""The shared atomic writer: a reader sees the old file or the whole new one, even with two
writers of one file (router workers share their state cache), and a failed write leaves the
target as it was."""

from __future__ import annotations

import json
import stat
import threading
from pathlib import Path

import pytest

from common import files


def test_two_writers_of_one_file_never_leave_half_a_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    bodies = {name: {"writer": name, "pad": name * 20000} for name in ("a", "b")}
    seen: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(name: str) -> None:
        try:
            for _ in range(200):
                files.write_json_atomic(target, bodies[name])
        except BaseException as exc:  # a thread's exception would not fail the test
            errors.append(exc)

    def read() -> None:
        while not stop.is_set():
            try:
                seen.append(json.loads(target.read_text())["writer"])
            except FileNotFoundError:
                pass
            except ValueError as exc:  # half a file
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(n,)) for n in bodies]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert not errors
    assert json.loads(target.read_text()) in bodies.values()
    assert set(seen) <= {"a", "b"} and seen  # every read parsed whole
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary file left


def test_a_failed_write_leaves_the_target_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "ready"
    files.write_ready_file(target, 7010)

    with pytest.raises(TypeError):
        files.write_bytes_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert files.read_ready_port(target) == 7010
    assert [p.name for p in tmp_path.iterdir()] == ["ready"]


def test_the_mode_is_the_new_files_whatever_the_umask(tmp_path: Path) -> None:
    secret = tmp_path / "tokens.json"
    files.write_text_atomic(secret, "{}", mode=0o600)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    files.write_text_atomic(secret, "{}", mode=0o644)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o644


def test_a_ready_file_is_absent_or_a_port(tmp_path: Path) -> None:
    ready = tmp_path / "child.port"
    assert files.read_ready_port(ready) is None
    files.write_ready_file(ready, 43210)
    assert files.read_ready_port(ready) == 43210
