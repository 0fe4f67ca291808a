"""The tenant form and the key form of the tenants' pages.

The form only turns text into values (models one per line, classes as boxes); the rules are
the tenants app's own (``services.tenant_errors``), judged for every value that converted, so
one save shows every problem, each beside its field.
"""

from __future__ import annotations

from typing import Any

from django import forms

from common.policy_schema import SLO_CLASSES
from common.tenants import MAX_LIMIT
from controlplane.dashboard.forms import AllErrorsForm
from controlplane.tenants import services
from controlplane.tenants.models import Tenant


class TenantForm(AllErrorsForm):
    name = forms.CharField(
        max_length=63, help_text="lower-case letters, digits, '-' or '_'; it does not change"
    )
    description = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 2}), max_length=2000
    )
    active = forms.BooleanField(required=False, initial=True, help_text="inactive: keys refused")
    rpm_limit = forms.IntegerField(
        label="Requests a minute",
        min_value=0,
        max_value=MAX_LIMIT,
        initial=0,
        help_text="at each router; 0: no limit",
    )
    tpm_limit = forms.IntegerField(
        label="Tokens a minute",
        min_value=0,
        max_value=MAX_LIMIT,
        initial=0,
        help_text="prompt and completion tokens, at each router; 0: no limit",
    )
    models = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="served model names it may use, one a line; empty: every model",
    )
    classes = forms.MultipleChoiceField(
        choices=[(c, c) for c in SLO_CLASSES],
        required=False,
        initial=list(SLO_CLASSES),
        widget=forms.CheckboxSelectMultiple,
        label="SLO classes",
    )
    default_class = forms.ChoiceField(
        choices=[(c, c) for c in SLO_CLASSES],
        initial="standard",
        help_text="the class of a request that names none",
    )

    def __init__(self, *args: Any, tenant: Tenant | None = None, **kwargs: Any) -> None:
        if tenant is not None and not args and "initial" not in kwargs:
            kwargs["initial"] = {
                **{name: getattr(tenant, name) for name in services.TENANT_FIELDS},
                "models": "\n".join(tenant.models),
            }
        super().__init__(*args, **kwargs)
        self.tenant = tenant
        if tenant is not None:
            del self.fields["name"]

    def clean_models(self) -> list[str]:
        text: str = self.cleaned_data.get("models") or ""
        return [line.strip() for line in text.splitlines() if line.strip()]

    def values(self) -> dict[str, Any]:
        """The settings that converted, as ``services.save_tenant`` takes them."""
        return {k: v for k, v in self.cleaned_data.items() if k in services.TENANT_FIELDS}

    def judge(self) -> dict[str, Any] | None:
        """The values to save, or None with every problem beside its field."""
        self.full_clean()
        values = self.values()
        for field, messages in services.tenant_errors(self.tenant, values).items():
            for message in messages:
                self.add_problem(field, message)
        return values if self.is_valid() else None


class IssueKeyForm(AllErrorsForm):
    label = forms.CharField(
        max_length=100, required=False, help_text="who or what will use it, e.g. 'eval jobs'"
    )
