"""Who acts: the type of every service's and audit call's keyword-only ``acting_user``.

An action is taken by one of three kinds of actor, and the audit row names it
(:func:`controlplane.core.audit.split_actor`):

- a person: ``request.user`` of the API, the dashboard or the admin, a Django user (or, as
  Django types it, possibly the anonymous user; the permission checks keep those out);
- a machine principal: an agent's or a router's token, ``request.user`` of a machine request
  (:class:`controlplane.access.principal.MachinePrincipal`), recorded by its label;
- the system: ``None`` (recorded as "system") or a label naming the process that acted
  ("reaper", "scheduler", ``schedule:<name>``, ``tenant:<owner>`` for a Batch API caller).

The machine principal is named by its shape rather than by its class because ``core`` sits below
``access`` in the import-linter layers (pyproject.toml).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser
    from django.contrib.auth.models import AnonymousUser


class Machine(Protocol):
    """An agent's or a router's principal: what ``MachinePrincipal`` offers an audit row."""

    @property
    def kind(self) -> str: ...

    @property
    def is_agent(self) -> bool: ...

    @property
    def is_router(self) -> bool: ...


# A person, as ``request.user`` is typed by Django and DRF.
Person: TypeAlias = "AbstractBaseUser | AnonymousUser"

# A process of the control plane acting on its own, by its label ("reaper", "scheduler").
SystemLabel: TypeAlias = str

# Who acts. None is the system without a label, recorded as "system".
Actor: TypeAlias = "Person | Machine | SystemLabel | None"
