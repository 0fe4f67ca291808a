"""Helpers for the browser tests: Debian's Chromium under Playwright, and a stand-in agent.

The stand-in agent is the agent's *side of the wire* only: it fetches its node's commands and
answers them through the real REST API with a real agent token, as agents/ does. It starts
no engines, because none can run inside this test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = REPO / "artifacts" / "screenshots"
DOC_SCREENSHOTS = REPO / "docs" / "screenshots"


def ensure_browser() -> None:
    """Install Debian's chromium and Playwright for Python if either is missing."""
    try:
        import playwright  # noqa: F401

        have_playwright = True
    except ImportError:
        have_playwright = False
    if have_playwright and os.access(CHROMIUM, os.X_OK):
        return
    setup = subprocess.run(
        ["bash", str(REPO / "scripts" / "dev" / "browser_setup.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if setup.returncode != 0 or not os.access(CHROMIUM, os.X_OK):
        raise RuntimeError(
            "scripts/dev/browser_setup.sh could not install chromium and playwright:\n"
            + setup.stdout[-2000:]
            + setup.stderr[-2000:]
        )


def save_screenshot(page: Any, name: str, *, for_docs: bool = False) -> Path:
    """Save a full-page PNG under artifacts/screenshots/, and under docs/screenshots/ too when
    SYSHAX_UPDATE_DOC_SCREENSHOTS=1 (the README's pictures are refreshed on purpose only)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if for_docs and os.environ.get("SYSHAX_UPDATE_DOC_SCREENSHOTS") == "1":
        DOC_SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOC_SCREENSHOTS / f"{name}.png")
    return path


class StandInAgent(threading.Thread):
    """Fetches its node's commands as an agent does (``GET agent/commands`` with the node's
    token) and answers each with success, ``delay`` seconds after taking it."""

    def __init__(self, base_url: str, token: str, delay: float = 0.6) -> None:
        super().__init__(daemon=True, name="stand-in-agent")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.delay = delay
        self.session = uuid.uuid4().hex
        self.handled: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=30) as http:
            while not self._stop_event.is_set():
                response = http.get(
                    "/api/v1/agent/commands", params={"session": self.session, "wait": "0.5"}
                )
                if response.status_code != 200:
                    self.errors.append(f"fetch: HTTP {response.status_code} {response.text}")
                    self._stop_event.wait(0.5)
                    continue
                for command in response.json()["commands"]:
                    time.sleep(self.delay)
                    self._answer(http, command)

    def _answer(self, http: httpx.Client, command: dict[str, Any]) -> None:
        containers = []
        if command["action"] == "start":
            spec = command["spec"]
            containers.append(
                {
                    "deployment_id": command["deployment_id"],
                    "generation": command["generation"],
                    "role": command["role"],
                    "engine_id": f"stand-in-{command['role']}",
                    "name": spec.get("name", ""),
                    "status": "running",
                    "health": "healthy",
                    "endpoint": f"http://127.0.0.1:{spec.get('port', 0)}",
                }
            )
        role = command["role"].upper()
        detail = f"{role} engine {command['action']}: done (stand-in agent)"
        response = http.post(
            f"/api/v1/commands/{command['dispatch_id']}/result",
            json={"status": "succeeded", "detail": detail, "containers": containers},
        )
        if response.status_code != 200:
            self.errors.append(f"{response.status_code} {response.text[:300]}")
        self.handled.append(command)
