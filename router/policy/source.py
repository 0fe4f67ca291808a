"""What the composition root (``router.cli``) asks of a policy source."""

from __future__ import annotations

from typing import Protocol


class PolicySource(Protocol):
    """Where the router's policy and deployments come from: a policy file and flags
    (``standalone.StandalonePolicy``) or the control plane (``managed.ControlPlaneClient``).
    ``router.cli`` builds one, attaches it once the listener is bound, runs it beside the
    listener and hands it SIGHUP."""

    def attach(self, listen_url: str) -> None: ...

    async def run(self) -> None: ...

    def hangup(self) -> None: ...
