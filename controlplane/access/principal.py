"""The request.user of a machine: not a Django user, and never staff."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.access.models import MachineCredential


@dataclass(frozen=True)
class MachinePrincipal:
    credential: MachineCredential

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False
    pk = None

    @property
    def kind(self) -> str:
        return self.credential.kind

    @property
    def node_id(self) -> int | None:
        return self.credential.node_id

    @property
    def is_agent(self) -> bool:
        return self.credential.kind == "agent"

    @property
    def is_router(self) -> bool:
        return self.credential.kind == "router"

    def has_perm(self, perm: str, obj: object = None) -> bool:
        return False

    def __str__(self) -> str:
        return f"{self.credential.kind}:{self.credential.name}"
