"""Dashboard forms. They collect input; the owning apps' services validate and act.

Field rules live once, in the services and models (placement, policy schema, run clean()), so
these forms only convert text to values and put the errors those layers raise beside the
field they name. A submission shows every problem at once: the form's own conversions and
the owning layer's rules for the values that converted, each beside its field and all of
them in a summary above the form.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from rest_framework import serializers

from common.policy_schema import KNOBS, Knob
from controlplane.benchmarks.api.serializers import ConcurrencyField, RatesField
from controlplane.benchmarks.choices import DEFAULT_CONCURRENCY, DEFAULT_ITERATIONS, BenchmarkMode
from controlplane.benchmarks.models import Scenario
from controlplane.deployments.models import Deployment, DeploymentProfile
from controlplane.inventory.models import Node, node_name_validator
from controlplane.policy.models import SchedulingPolicy


class AllErrorsForm(forms.Form):
    """A form that gathers the owning layers' errors beside its own and lists them all."""

    def add_problem(self, field: str | None, message: str) -> None:
        """Put a rule's error beside ``field`` (above the form when it has no such field),
        unless the field already shows one: a value that did not convert is not judged."""
        target = field if field in self.fields else None
        if target is not None and target in self.errors:
            return
        self.add_error(target, message)

    def error_summary(self) -> list[tuple[str, str, str]]:
        """(input id, label, message) of every error: the form's own, then in field order."""
        items = [("", "", str(error)) for error in self.non_field_errors()]
        for bound in self:
            items.extend((bound.id_for_label, str(bound.label), str(e)) for e in bound.errors)
        return items


class DeploymentCreateForm(AllErrorsForm):
    name = forms.CharField(
        max_length=63,
        validators=[node_name_validator],
        help_text="lower-case letters, digits and '-'",
    )
    profile = forms.ModelChoiceField(queryset=DeploymentProfile.objects.all())
    node = forms.ModelChoiceField(
        queryset=Node.objects.all(),
        to_field_name="name",
        required=False,
        empty_label="let the control plane choose",
        help_text="a named node pins the deployment there",
    )
    node_selector = forms.CharField(
        required=False,
        max_length=1024,
        label="Node labels",
        help_text="when the control plane chooses: labels the node must carry, e.g. rack=r1",
    )
    policy = forms.ModelChoiceField(
        queryset=SchedulingPolicy.objects.all(),
        required=False,
        empty_label="default",
        help_text="the PD policy its routers apply",
    )
    start = forms.BooleanField(required=False, initial=True, label="Deploy now")

    def clean_name(self) -> str:
        name: str = self.cleaned_data["name"]
        if Deployment.objects.filter(name=name).exists():
            raise ValidationError(f"a deployment named {name!r} already exists")
        return name

    def clean_node_selector(self) -> dict[str, str]:
        text: str = self.cleaned_data["node_selector"]
        labels: dict[str, str] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValidationError(f"{item!r}: write labels as name=value, comma-separated")
            labels[key.strip()] = value.strip()
        return labels

    def add_service_error(self, field: str, message: str) -> None:
        """Put an error a service raised beside its field; profile knobs go to the node."""
        if field in self.fields:
            self.add_error(field, message)
        else:
            self.add_error("node", f"{field}: {message}")


def knob_field(knob: Knob) -> forms.Field:
    attrs: dict[str, Any] = {"aria-describedby": f"meaning-{knob.name}"}
    if knob.minimum is not None:
        attrs["min"] = knob.minimum
    if knob.maximum is not None:
        attrs["max"] = knob.maximum
    common: dict[str, Any] = {"label": knob.name, "help_text": knob.meaning}
    if knob.kind is bool:
        return forms.BooleanField(required=False, **common)
    if knob.choices is not None:
        return forms.ChoiceField(choices=[(c, c) for c in knob.choices], **common)
    if knob.kind is int:
        return forms.IntegerField(widget=forms.NumberInput(attrs=attrs), **common)
    return forms.FloatField(widget=forms.NumberInput(attrs={**attrs, "step": "any"}), **common)


class PolicyForm(AllErrorsForm):
    """Every knob of common.policy_schema plus the reason the change is recorded with."""

    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2}),
        max_length=2000,
        help_text="why this change; it is stored with the revision",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        reason = self.fields.pop("reason")
        for knob in KNOBS:
            self.fields[knob.name] = knob_field(knob)
        self.fields["reason"] = reason

    def knob_values(self) -> dict[str, Any]:
        """The knobs that converted (all of them once the form is valid)."""
        data = self.cleaned_data
        return {knob.name: data[knob.name] for knob in KNOBS if knob.name in data}

    def knob_fields(self) -> list[tuple[forms.BoundField, Knob]]:
        return [(self[knob.name], knob) for knob in KNOBS]


# The benchmarks app's one definition of a run's defaults (the admin and schedules use it too).
DEFAULT_LEVELS = ",".join(str(level) for level in DEFAULT_CONCURRENCY)


class BenchmarkRunForm(AllErrorsForm):
    name = forms.CharField(max_length=128, required=False)
    scenario = forms.ModelChoiceField(queryset=Scenario.objects.all(), to_field_name="name")
    deployment = forms.ModelChoiceField(
        queryset=Deployment.objects.all(), required=False, empty_label="(a target URL instead)"
    )
    target_url = forms.URLField(
        required=False, assume_scheme="http", help_text="router or engine URL"
    )
    mode = forms.ChoiceField(choices=BenchmarkMode.choices, initial=BenchmarkMode.HETERO)
    concurrency = forms.CharField(
        initial=DEFAULT_LEVELS, help_text="levels: 8, 1,2,4,8 or a range 1-8"
    )
    iterations = forms.IntegerField(
        initial=DEFAULT_ITERATIONS,
        help_text="requests per level and mode; a level of c sends them c at a time",
    )
    warmup = forms.IntegerField(initial=0)
    request_rates = forms.CharField(
        required=False,
        help_text="goodput sweep: ascending requests/s, e.g. 1,2,4,8 (then concurrency is "
        "not used); needs an SLO",
    )
    slo_ttft_ms = forms.FloatField(required=False, min_value=0.001, label="SLO TTFT (ms)")
    slo_tpot_ms = forms.FloatField(required=False, min_value=0.001, label="SLO TPOT (ms)")
    find_max_goodput = forms.BooleanField(
        required=False, help_text="bisect towards the highest rate meeting 90 % attainment"
    )

    def clean_request_rates(self) -> list[float]:
        raw = self.cleaned_data.get("request_rates") or ""
        try:
            return list(RatesField().to_internal_value(raw.strip()))
        except serializers.ValidationError as exc:
            raise ValidationError([str(d) for d in exc.detail]) from None

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("request_rates") and not (data.get("slo_ttft_ms") or data.get("slo_tpot_ms")):
            self.add_error("slo_ttft_ms", "a goodput sweep needs an SLO TTFT or TPOT")
        return data

    def clean_concurrency(self) -> list[int]:
        return self._levels(self.cleaned_data["concurrency"])

    @staticmethod
    def _levels(text: str) -> list[int]:
        raw = text.strip()
        value: Any = int(raw) if raw.isdigit() else raw
        try:
            levels: list[int] = ConcurrencyField().to_internal_value(value)
        except serializers.ValidationError as exc:
            raise ValidationError([str(d) for d in exc.detail]) from None
        return levels

    def run_fields(self) -> dict[str, Any]:
        data = dict(self.cleaned_data)
        data["target_url"] = data.get("target_url") or ""
        data["request_rates"] = data.get("request_rates") or []
        return data

    def add_model_errors(self, errors: dict[str, list[str]]) -> None:
        for field, messages in errors.items():
            for message in messages:
                self.add_problem(field, message)

    def estimate_fields(self) -> dict[str, Any] | None:
        """What a run's length depends on, from the submitted values or, unsubmitted, the
        defaults; None where one of them did not convert."""
        names = ("scenario", "mode", "concurrency", "iterations", "warmup", "request_rates")
        if not self.is_bound:
            initial = {name: self.get_initial_for_field(self.fields[name], name) for name in names}
            scenario = Scenario.objects.filter(name=initial["scenario"]).first()
            if scenario is None:
                return None
            return {
                **initial,
                "scenario": scenario,
                "concurrency": self._levels(initial["concurrency"]),
            }
        data = self.cleaned_data
        if any(name not in data or name in self.errors for name in names):
            return None
        return {name: data[name] for name in names}
