"""The KV connector's own tests, with its two sides driven as vLLM drives them
(kvbench/harness.py). They need torch, so they run in the real-engine tier's vLLM
virtualenv: ``tests/realengine/test_connector_units.py`` runs them there and fails if any
fails. Collected by an interpreter without torch they are left out, and run there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]
else:

    @pytest.fixture
    def shm_dir(tmp_path: Path) -> Path:
        path = tmp_path / "shm"
        path.mkdir()
        return path

    @pytest.fixture
    def pair(shm_dir: Path) -> Iterator[Any]:
        from tests.kvconnector.pairs import close, make_pair

        engines = make_pair(shm_dir)
        yield engines
        close(engines)
