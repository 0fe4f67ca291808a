"""Tenants, their API keys and the usage routers report for them (docs/tenants.md).

A tenant's rules on one row live in :meth:`Tenant.clean`, so the admin's form, the API and
the dashboard (through ``services.save_tenant``, which runs ``full_clean``) refuse the same
values with every error at once, each under its field.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, RegexValidator
from django.db import models

from common.policy_schema import SLO_CLASSES
from common.tenants import MAX_LIMIT, NAME_RE, TenantError, TenantRecord, check_classes
from controlplane.core.models import TimeStampedModel
from controlplane.routers.models import RouterInstance
from controlplane.tenants.choices import RESERVED_NAMES

# A tenant may name at most this many models, each at most this long (a served model name).
MAX_MODELS = 100
MAX_MODEL_NAME = 200

name_validator = RegexValidator(
    NAME_RE, "1-63 lower-case letters, digits, '-' or '_', starting with a letter or digit"
)


def all_classes() -> list[str]:
    return list(SLO_CLASSES)


def _model_names(value: Any) -> str:
    """Why ``value`` is not a list of served model names, or ""."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return "must be a list of model names (empty: every model)"
    if len(value) > MAX_MODELS:
        return f"at most {MAX_MODELS} models; got {len(value)}"
    for name in value:
        if not name.strip() or name != name.strip():
            return f"{name!r}: a model name is not blank and has no surrounding spaces"
        if len(name) > MAX_MODEL_NAME:
            return f"{name[:20]!r}...: a model name has at most {MAX_MODEL_NAME} characters"
    if len(set(value)) != len(value):
        return "names a model twice"
    return ""


class Tenant(TimeStampedModel):
    """Who may call the routers, how often, for which models and SLO classes."""

    name = models.CharField(
        max_length=63,
        unique=True,
        validators=[name_validator],
        help_text="how routers, metrics and usage know the tenant; it does not change",
    )
    description = models.TextField(blank=True)
    active = models.BooleanField(
        default=True, help_text="an inactive tenant's keys are refused by every router"
    )
    rpm_limit = models.PositiveIntegerField(
        default=0,
        validators=[MaxValueValidator(MAX_LIMIT)],
        help_text="requests a minute, over all routers each on its own; 0: no limit",
    )
    tpm_limit = models.PositiveIntegerField(
        default=0,
        validators=[MaxValueValidator(MAX_LIMIT)],
        help_text="prompt and completion tokens a minute; 0: no limit",
    )
    classes = models.JSONField(
        default=all_classes, help_text=f"SLO classes it may use, of {', '.join(SLO_CLASSES)}"
    )
    default_class = models.CharField(
        max_length=16,
        choices=[(c, c) for c in SLO_CLASSES],
        default="standard",
        help_text="the class of a request that names none",
    )
    # Last: from here on, ``models`` in this class body is this field, not django.db.models.
    models = models.JSONField(
        default=list, blank=True, help_text="served model names it may use; empty: every model"
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors: dict[str, list[str]] = {}
        if self.name in RESERVED_NAMES:
            errors["name"] = [f"{self.name!r} is the name routers give their own callers"]
        if why := _model_names(self.models):
            errors["models"] = [why]
        if not isinstance(self.classes, list) or not all(isinstance(c, str) for c in self.classes):
            errors["classes"] = [f"must be a list of SLO classes, of {', '.join(SLO_CLASSES)}"]
        else:
            try:
                check_classes(tuple(self.classes), self.default_class)
            except TenantError as exc:
                errors.setdefault(exc.field.rsplit(".", 1)[-1], []).append(exc.message)
            if len(set(self.classes)) != len(self.classes):
                errors.setdefault("classes", []).append("names a class twice")
        if errors:
            raise ValidationError(errors)

    def record(self, key_hashes: frozenset[str]) -> TenantRecord:
        """The tenant as routers read it (``common.tenants``), with these keys."""
        return TenantRecord(
            name=self.name,
            key_hashes=key_hashes,
            rpm_limit=self.rpm_limit,
            tpm_limit=self.tpm_limit,
            models=tuple(self.models),
            classes=tuple(self.classes),
            default_class=self.default_class,
        )


class TenantKey(models.Model):
    """One API key of a tenant. Only its SHA-256 is stored; the key is shown once, when
    ``services.issue_key`` makes it."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="keys")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(
        max_length=16, editable=False, help_text="its first characters, to tell keys apart"
    )
    label = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_by_label = models.CharField(
        max_length=150, blank=True, help_text="machine credential or CLI when no user acted"
    )
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["tenant", "-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.tenant.name}: {self.prefix}… {self.label}".rstrip()

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class TenantUsage(models.Model):
    """What one router served and refused for one tenant in one minute: the sum of the
    deltas it reported in that minute (by the control plane's clock)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage")
    router = models.ForeignKey(
        RouterInstance, on_delete=models.CASCADE, related_name="tenant_usage"
    )
    minute = models.DateTimeField(help_text="the minute's start")
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    rejected = models.JSONField(default=dict, blank=True, help_text="refusals by reason")

    class Meta:
        ordering = ["-minute", "tenant", "router"]
        verbose_name_plural = "tenant usage"
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "router", "minute"], name="tenant_usage_one_row_a_minute"
            )
        ]
        indexes = [models.Index(fields=["tenant", "minute"], name="tenant_usage_time_idx")]

    def __str__(self) -> str:
        return f"{self.tenant.name} via {self.router.name} @ {self.minute:%Y-%m-%d %H:%M}"
