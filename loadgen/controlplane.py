"""``syshax benchmark --deployment NAME``: find the deployment's model and a live router
through the control plane's REST API, and afterwards read the node's resource use during each
row from the agents' heartbeats. Synchronous httpx; it runs before and after the load."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from statistics import fmean
from typing import Any

import httpx


class ControlPlaneError(RuntimeError):
    pass


@dataclass(frozen=True)
class DeploymentTarget:
    name: str
    deployment_id: int
    node_id: int
    model: str
    router_url: str


class ControlPlane:
    def __init__(self, url: str, token: str | None, timeout: float = 10.0) -> None:
        headers = {"Authorization": f"Token {token}"} if token else {}
        self.client = httpx.Client(
            base_url=url.rstrip("/") + "/api/v1/", headers=headers, timeout=timeout
        )

    def close(self) -> None:
        self.client.close()

    def _get(self, path: str, **params: Any) -> Any:
        try:
            response = self.client.get(path, params=params)
        except httpx.HTTPError as exc:
            raise ControlPlaneError(f"cannot reach the control plane: {exc}") from None
        if response.status_code in (401, 403):
            raise ControlPlaneError(
                f"the control plane refused {path} ({response.status_code}); "
                "give a user's API token with --token or SYSHAX_TOKEN"
            )
        if response.status_code >= 400:
            raise ControlPlaneError(f"GET {path}: {response.status_code} {response.text[:200]}")
        return response.json()

    def resolve(self, name: str) -> DeploymentTarget:
        routable = self._get("routing/deployments")["deployments"]
        match = next((d for d in routable if d["name"] == name), None)
        if match is None:
            raise ControlPlaneError(f"deployment {name!r} is not running (or does not exist)")
        detail = self._get(f"deployments/{match['id']}/")
        routers = self._get("routers/", limit=100)["results"]
        # The router's key goes only to an address the operator configured (ROUTER_URLS),
        # never to one a router merely reported (decision record 56).
        live = [
            r
            for r in routers
            if r.get("is_alive") and r.get("listen_url") and r.get("listen_url_configured")
        ]
        if not live:
            raise ControlPlaneError(
                "no live router at an address in the control plane's ROUTER_URLS; start "
                "`syshax router` and list its URL there, or pass --target"
            )
        return DeploymentTarget(
            name, match["id"], detail["node"], match["model"], live[0]["listen_url"]
        )

    def resources(self, node_id: int, start: float, end: float) -> dict[str, float | None]:
        """Mean and peak of the node's heartbeats received between ``start`` and ``end``
        (epoch seconds)."""
        beats = self._get(f"nodes/{node_id}/heartbeats", limit=1000)["results"]
        inside = [
            b for b in beats if start <= datetime.fromisoformat(b["received_at"]).timestamp() <= end
        ]
        return summarize_heartbeats(inside)


def summarize_heartbeats(beats: list[dict[str, Any]]) -> dict[str, float | None]:
    """CPU %, memory and accelerator utilisation and memory over a set of heartbeats."""
    if not beats:
        return {
            "heartbeats": 0.0,
            "cpu_percent_mean": None,
            "cpu_percent_max": None,
            "memory_used_gb_max": None,
            "accelerator_util_mean": None,
            "accelerator_memory_used_gb_max": None,
        }
    cpu = [float(b["cpu_percent"]) for b in beats]
    memory = [float(b["memory_used_bytes"]) / 1024**3 for b in beats]
    util = [float(a.get("utilization_percent", 0.0)) for b in beats for a in b["accelerators"]]
    acc_mem = [
        sum(float(a.get("memory_used_bytes", 0)) for a in b["accelerators"]) / 1024**3
        for b in beats
    ]
    return {
        "heartbeats": float(len(beats)),
        "cpu_percent_mean": fmean(cpu),
        "cpu_percent_max": max(cpu),
        "memory_used_gb_max": max(memory),
        "accelerator_util_mean": fmean(util) if util else None,
        "accelerator_memory_used_gb_max": max(acc_mem) if acc_mem else None,
    }
