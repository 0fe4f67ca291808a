"""The agent's HTTP client of the control plane (docs/machine-api.md), with back-off.

Transport failures, timeouts and 5xx answers raise :class:`Unreachable`, which callers retry
with :func:`backoff_delay`; a 4xx is the agent's own fault and raises
:class:`ControlPlaneError` with the control plane's error message, so it is logged rather than
hammered.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import httpx

from agents import __version__


class Unreachable(Exception):
    """The control plane could not be reached or failed (5xx): retry later."""


class ControlPlaneError(Exception):
    """The control plane refused the agent's request (4xx): its ``error.code`` and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code


def backoff_delay(
    attempt: int, *, base: float = 0.5, cap: float = 30.0, rng: random.Random | None = None
) -> float:
    """Full-jitter exponential back-off: uniform in [0, min(cap, base * 2**attempt)].

    The jitter spreads a fleet of agents that lost the control plane at the same moment, so
    they do not all come back in one thundering burst.
    """
    ceiling = min(cap, base * 2 ** min(attempt, 30))
    return (rng or random).uniform(0, ceiling)


# How far each heartbeat's wait is spread either way, as a fraction of the interval.
HEARTBEAT_JITTER = 0.1


def jittered(
    interval: float, *, spread: float = HEARTBEAT_JITTER, rng: random.Random | None = None
) -> float:
    """The wait before the next heartbeat: ``interval`` spread uniformly by ``spread`` of
    itself either way, so the mean stays the interval.

    A fleet's heartbeats are answered together: the control plane commits them in groups, and
    agents that started or came back together register together. Waiting the same interval
    from the same answer, they would arrive together for ever, a burst every interval that
    each makes the next group larger; spread this much, a group dissolves within a few
    intervals (docs/agent.md). The longest wait, 1.1 intervals, stays far inside the
    control plane's grace period of three."""
    return interval * (rng or random).uniform(1 - spread, 1 + spread)


class ControlPlaneClient:
    def __init__(self, base_url: str, token: str, *, timeout: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.base_url + "/api/v1/",
            timeout=timeout,
            headers={
                "Authorization": f"Bearer {token}",
                "User-Agent": f"syshax-agent/{__version__}",
            },
        )

    def close(self) -> None:
        self.http.close()

    def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        if headers:
            extra["headers"] = headers
        try:
            response = self.http.request(method, path, json=body, params=params, **extra)
        except httpx.HTTPError as exc:
            raise Unreachable(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 500:
            raise Unreachable(f"{method} {path}: HTTP {response.status_code}")
        if response.status_code >= 400:
            code, message = "http_error", response.text[:300]
            try:
                error = response.json()["error"]
                code, message = str(error.get("code", code)), str(error.get("message", message))
            except (ValueError, KeyError, TypeError):
                pass
            raise ControlPlaneError(response.status_code, code, message)
        return response.json() if response.content else {}

    def agent_self(self) -> dict[str, Any]:
        data: dict[str, Any] = self._call("GET", "agent/self")
        return data

    def put_inventory(self, node_id: int, inventory: Mapping[str, Any]) -> dict[str, Any]:
        data: dict[str, Any] = self._call("PUT", f"nodes/{node_id}/inventory", inventory)
        return data

    def heartbeat(self, node_id: int, payload: Mapping[str, Any]) -> dict[str, Any]:
        data: dict[str, Any] = self._call("POST", f"nodes/{node_id}/heartbeat", payload)
        return data

    def fetch_commands(self, session: str, wait: float) -> list[dict[str, Any]]:
        """This node's commands not yet handed to ``session``; the control plane holds the
        request up to ``wait`` seconds when there is none."""
        data = self._call(
            "GET",
            "agent/commands",
            params={"session": session, "wait": f"{wait:g}"},
            timeout=wait + 10.0,
        )
        commands: list[dict[str, Any]] = data.get("commands", [])
        return commands

    def command_result(
        self, dispatch_id: str, result: Mapping[str, Any], traceparent: str = ""
    ) -> dict[str, Any]:
        """The command's result; ``traceparent``: the agent's span for the command, whose
        trace the control plane's handling of the result joins (docs/tracing.md)."""
        headers = {"traceparent": traceparent} if traceparent else None
        data: dict[str, Any] = self._call(
            "POST", f"commands/{dispatch_id}/result", result, headers=headers
        )
        return data

    def put_containers(self, node_id: int, containers: list[dict[str, Any]]) -> dict[str, Any]:
        data: dict[str, Any] = self._call(
            "PUT", f"nodes/{node_id}/containers", {"containers": containers}
        )
        return data
