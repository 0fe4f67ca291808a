"""The profile form and the profile page's settings: one field per engine setting.

The form only turns text into the values the REST API takes (a list of arguments from one per
line, an env from NAME=VALUE lines, an empty number as "unset"). The rules are the API's own:
:func:`judge` runs ``ProfileSerializer`` (each field's limits, the unique name) and the
model's ``clean()`` through it, and collects every error at once, each beside its field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django import forms
from django.db import models
from rest_framework import serializers

from controlplane.deployments.api.serializers import ProfileSerializer
from controlplane.deployments.masking import hide_env
from controlplane.deployments.models import DeploymentProfile

# Every setting of a profile, in the groups its page and its form show them in.
GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "model",
        "Model",
        (
            "name",
            "description",
            "model",
            "served_model_name",
            "quantization",
            "engine",
            "sim_gpu_device",
            "sim_cpu_device",
            "max_model_len",
            "health_timeout_seconds",
        ),
    ),
    (
        "gpu",
        "GPU engine",
        (
            "gpu_image",
            "gpu_command",
            "gpu_extra_args",
            "gpu_port",
            "tensor_parallel_size",
            "gpu_memory_utilization",
            "max_num_seqs",
            "preemption_mode",
        ),
    ),
    (
        "cpu",
        "CPU engine",
        (
            "enable_cpu_engine",
            "cpu_image",
            "cpu_command",
            "cpu_extra_args",
            "cpu_port",
            "cpu_max_num_seqs",
            "omp_num_threads",
            "cpu_affinity_mode",
            "cpu_affinity",
            "cpu_kv_cache_space_gb",
            "cpu_memory_limit_gb",
        ),
    ),
    ("pd", "PD handoff and KV", ("pd_protocol", "kv_arena_mib", "gpu_shm_size_gb")),
    ("tracing", "Tracing", ("otlp_traces_endpoint", "trace_detail")),
    ("env", "Environment", ("gpu_env", "cpu_env")),
)
ARG_FIELDS = ("gpu_command", "gpu_extra_args", "cpu_command", "cpu_extra_args")
ENV_FIELDS = ("gpu_env", "cpu_env")
SETTINGS = tuple(name for _key, _title, names in GROUPS for name in names)


def _model_field(name: str) -> models.Field[Any, Any]:
    field = DeploymentProfile._meta.get_field(name)
    assert isinstance(field, models.Field)
    return field


def _text(value: Any) -> str:
    """A stored value as the form's text."""
    if value is None:
        return ""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


class ArgLinesField(forms.Field):
    """One argument per line: ``--enforce-eager`` on one line, ``--seed`` and ``7`` on two."""

    widget = forms.Textarea(attrs={"rows": 3, "spellcheck": "false"})

    def prepare_value(self, value: Any) -> Any:
        return "\n".join(value) if isinstance(value, list) else value

    def to_python(self, value: Any) -> list[str]:
        text = "" if value is None else str(value)
        return [line.strip() for line in text.splitlines() if line.strip()]


class EnvLinesField(forms.Field):
    """One ``NAME=VALUE`` per line."""

    widget = forms.Textarea(attrs={"rows": 3, "spellcheck": "false"})

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, dict):
            return "\n".join(f"{k}={v}" for k, v in value.items())
        return value

    def to_python(self, value: Any) -> dict[str, str]:
        text = "" if value is None else str(value)
        env: dict[str, str] = {}
        bad: list[str] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            name, sep, val = line.partition("=")
            if not sep or not name.strip():
                bad.append(f"line {number}: expected NAME=VALUE, got {line.strip()!r}")
                continue
            env[name.strip()] = val
        if bad:
            raise forms.ValidationError(bad)
        return env


def _form_field(name: str) -> forms.Field:
    field = _model_field(name)
    kwargs: dict[str, Any] = {"label": name, "help_text": field.help_text, "required": False}
    if name in ARG_FIELDS:
        words = f"{field.help_text}; one argument per line" if field.help_text else ""
        return ArgLinesField(**{**kwargs, "help_text": words or "one argument per line"})
    if name in ENV_FIELDS:
        return EnvLinesField(**{**kwargs, "help_text": "one NAME=VALUE per line"})
    if field.choices:
        return forms.ChoiceField(choices=field.choices, **kwargs)
    if isinstance(field, models.BooleanField):
        return forms.BooleanField(**kwargs)
    if isinstance(field, models.TextField):
        return forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), strip=False, **kwargs)
    attrs = {"spellcheck": "false"}
    if isinstance(field, models.IntegerField):
        attrs["inputmode"] = "numeric"
    elif isinstance(field, models.FloatField):
        attrs["inputmode"] = "decimal"
    return forms.CharField(widget=forms.TextInput(attrs=attrs), **kwargs)


class ProfileForm(forms.Form):
    """Every setting of a profile as text; :func:`judge` checks them."""

    def __init__(
        self, *args: Any, instance: DeploymentProfile | None = None, **kwargs: Any
    ) -> None:
        self.instance = instance
        if "initial" not in kwargs:
            source = instance if instance is not None else DeploymentProfile()
            kwargs["initial"] = {name: _initial(source, name) for name in SETTINGS}
        super().__init__(*args, **kwargs)
        for name in SETTINGS:
            self.fields[name] = _form_field(name)

    def groups(self) -> list[tuple[str, str, list[forms.BoundField]]]:
        return [(key, title, [self[name] for name in names]) for key, title, names in GROUPS]

    def values(self) -> dict[str, Any]:
        """The converted values of the fields that converted, as the API takes them."""
        values: dict[str, Any] = {}
        for name, value in self.cleaned_data.items():
            field = _model_field(name)
            if isinstance(value, str) and not value.strip() and field.null:
                value = None  # an empty number: unset
            values[name] = value
        return values


def _initial(profile: DeploymentProfile, name: str) -> Any:
    value = getattr(profile, name)
    if name in ARG_FIELDS or name in ENV_FIELDS or isinstance(value, bool):
        return value
    return _text(value)


def judge(form: ProfileForm) -> dict[str, Any] | None:
    """The validated values, or None with every error added to ``form`` beside its field.

    The API's serializer checks each field; where some fail, it would not reach the model's
    ``clean()``, so that runs here through the serializer's own ``validate`` on the fields that
    passed, and the operator sees every error of one save at once."""
    converted = form.is_valid()  # False: an env line without "=" and the like
    values = form.values()
    instance = form.instance
    serializer = ProfileSerializer(instance, data=values, partial=instance is not None)
    if serializer.is_valid():
        return dict(serializer.validated_data) if converted else None
    errors: dict[str, Any] = dict(serializer.errors)
    if set(errors) - {"non_field_errors"}:
        passed: dict[str, Any] = {}
        for name, value in values.items():
            if name in errors or name in form.errors:
                continue
            try:
                passed[name] = serializer.fields[name].run_validation(value)
            except serializers.ValidationError:
                continue
        try:
            serializer.validate(passed)
        except serializers.ValidationError as exc:
            detail = exc.detail if isinstance(exc.detail, dict) else {}
            for key, messages in detail.items():
                errors.setdefault(str(key), messages)
    for name, messages in errors.items():
        field = name if name in form.fields else None
        if field is not None and field in form.errors:
            continue  # its text did not convert: that error says enough
        for message in messages if isinstance(messages, list) else [messages]:
            form.add_error(field, str(message))
    return None


@dataclass(frozen=True)
class Setting:
    name: str
    value: str  # as text; "" when unset
    help: str
    lines: tuple[str, ...] = ()  # a list or an env, one entry per line


def settings_of(
    profile: DeploymentProfile, *, show_secrets: bool
) -> list[tuple[str, str, list[Setting]]]:
    """Every setting of ``profile`` as text, in its group. The env values are ``<hidden>``
    unless ``show_secrets`` (masking.may_see_env), as the API shows them."""
    out: list[tuple[str, str, list[Setting]]] = []
    for key, title, names in GROUPS:
        rows: list[Setting] = []
        for name in names:
            field = _model_field(name)
            value = getattr(profile, name)
            lines: tuple[str, ...] = ()
            if name in ENV_FIELDS:
                env = value if show_secrets else hide_env(value or {})
                lines = tuple(f"{k}={v}" for k, v in (env or {}).items())
                text = ""
            elif name in ARG_FIELDS:
                lines = tuple(value or ())
                text = ""
            elif field.choices:
                label = str(getattr(profile, f"get_{name}_display")())
                text = value if label == value else f"{value}: {label}"
            elif isinstance(value, bool):
                text = "yes" if value else "no"
            else:
                text = _text(value)
            rows.append(Setting(name, text, str(field.help_text), lines))
        out.append((key, title, rows))
    return out
