"""Base viewsets: machine scoping lives here so each app's viewsets stay three lines."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from rest_framework import viewsets

from controlplane.access.principal import MachinePrincipal


class ScopedViewSetMixin:
    """Declare ``agent_methods``/``router_methods`` and ``node_field`` on a viewset.

    For an agent, lists are cut to rows of its own node, and a single object of another
    node answers 403 through ``ScopedPermission.has_object_permission``.
    """

    agent_methods: tuple[str, ...] = ()
    router_methods: tuple[str, ...] = ()
    node_field: str | None = None  # path from the model to its Node, e.g. "deployment__node"

    def get_queryset(self) -> QuerySet[Any]:
        queryset: QuerySet[Any] = super().get_queryset()  # type: ignore[misc]
        user = self.request.user  # type: ignore[attr-defined]
        if isinstance(user, MachinePrincipal) and user.is_agent:
            if self.node_field is None:
                return queryset.none()
            if getattr(self, "detail", False):
                # A single object: let the object permission answer 403 for another node's.
                return queryset
            return queryset.filter(**{self.node_field: user.node_id})
        return queryset

    def node_id_of(self, obj: Any) -> int | None:
        if self.node_field is None:
            return None
        if self.node_field == "pk":
            return int(obj.pk)
        *path, last = self.node_field.split("__")
        for part in path:
            obj = getattr(obj, part)
        return getattr(obj, f"{last}_id", None)


class ScopedModelViewSet(ScopedViewSetMixin, viewsets.ModelViewSet):  # type: ignore[type-arg]
    pass


class ScopedReadOnlyViewSet(ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):  # type: ignore[type-arg]
    pass
