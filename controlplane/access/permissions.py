"""Who may do what. One permission class reads the view's declared machine scopes.

- People (Django users, by session or DRF token) may read everything; writing needs the
  model's Django permission (add/change/delete), so operators are managed with groups.
- Agents may use only the methods a view lists in ``agent_methods`` and, object by object, only
  what belongs to their own node (``view.node_id_of(obj)``).
- Routers may use only the methods a view lists in ``router_methods``.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from controlplane.access.principal import MachinePrincipal

_ACTION_PERMISSION = {
    "create": "add",
    "update": "change",
    "partial_update": "change",
    "destroy": "delete",
}


class ScopedPermission(BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if user is None or not user.is_authenticated:
            return False
        if isinstance(user, MachinePrincipal):
            allowed = getattr(view, "agent_methods" if user.is_agent else "router_methods", ())
            return request.method in allowed
        if request.method in SAFE_METHODS:
            return True
        return user.has_perm(self._required_perm(view))

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        user = request.user
        if isinstance(user, MachinePrincipal) and user.is_agent:
            node_id_of = getattr(view, "node_id_of", None)
            return node_id_of is not None and node_id_of(obj) == user.node_id
        return True

    @staticmethod
    def _required_perm(view: Any) -> str:
        explicit = getattr(view, "required_perm", None)
        if explicit:
            return str(explicit)
        if not hasattr(view, "get_queryset"):
            # Machine-only endpoints: no person holds this, superusers are refused by the view.
            return "access.machine_endpoint"
        model = view.get_queryset().model
        action = _ACTION_PERMISSION.get(getattr(view, "action", "") or "", "change")
        return f"{model._meta.app_label}.{action}_{model._meta.model_name}"
