"""Pagination and ordering that refuse what they cannot honour instead of guessing (or 500ing).

DRF's ``LimitOffsetPagination`` ignores a ``limit`` or ``offset`` it cannot parse and serves
whatever ``limit`` is asked for. Here a bad value is a 400 naming the parameter, and ``limit``
is capped, so no request can make the API build an unbounded page.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db.models import QuerySet
from rest_framework.exceptions import ValidationError
from rest_framework.filters import OrderingFilter
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

MAX_PAGE_SIZE = 1000


def _bounded_int(request: Request, name: str, *, low: int, high: int | None) -> int | None:
    raw = request.query_params.getlist(name)
    if not raw:
        return None
    if len(raw) > 1:
        raise ValidationError({name: [f"give {name} once, not {len(raw)} times"]})
    text = raw[0]
    value = int(text) if text.isdigit() else None
    if value is None or value < low or (high is not None and value > high):
        limits = f"{low}-{high}" if high is not None else f"at least {low}"
        raise ValidationError({name: [f"must be an integer {limits}, got {text!r}"]})
    return value


class StrictLimitOffsetPagination(LimitOffsetPagination):
    max_limit = MAX_PAGE_SIZE

    def get_limit(self, request: Request) -> int | None:
        value = _bounded_int(request, self.limit_query_param, low=1, high=self.max_limit)
        return self.default_limit if value is None else value

    def get_offset(self, request: Request) -> int:
        value = _bounded_int(request, self.offset_query_param, low=0, high=None)
        return 0 if value is None else value

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.limit_query_param:
                parameter["schema"] |= {"minimum": 1, "maximum": self.max_limit}
            elif parameter["name"] == self.offset_query_param:
                parameter["schema"] |= {"minimum": 0}
        return parameters


class ModelFieldOrderingFilter(OrderingFilter):
    """``?ordering=`` over the serializer's fields that are columns of the queryset's model.

    DRF's default offers every readable serializer field, including computed ones (a property,
    an annotation of another view), and ordering by one of those is a database error (a 500)."""

    def get_valid_fields(
        self, queryset: QuerySet[Any], view: Any, context: Mapping[str, Any] | None = None
    ) -> list[tuple[str, str]]:
        fields = super().get_valid_fields(queryset, view, dict(context or {}))
        if getattr(view, "ordering_fields", None) not in (None, "__all__"):
            return list(fields)  # the view chose them
        columns = {f.name for f in queryset.model._meta.get_fields()} | {
            f.attname for f in queryset.model._meta.concrete_fields
        }
        return [(name, label) for name, label in fields if name.split("__")[0] in columns]
