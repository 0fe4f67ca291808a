"""Who sees the values of a profile's engine env, and the one function that hides them.

A profile's ``gpu_env``/``cpu_env`` is where a Hugging Face token (``HF_TOKEN``) sits. Its
values are shown only to people who may change profiles; everyone else sees the names with
``<hidden>`` values, wherever the env shows: the profile itself (API, admin), its rendered
command lines (dashboard, admin) and the spec of every command, which carries that env to the
agent (API, admin). The agent's own command fetch (``GET agent/commands``) hands its node's
agent the real values: it runs the engines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

HIDDEN = "<hidden>"
SEE_ENV_PERMISSION = "deployments.change_deploymentprofile"


def may_see_env(user: Any) -> bool:
    """Whether ``user`` (a person, a machine principal or None) sees env values."""
    return user is not None and bool(user.has_perm(SEE_ENV_PERMISSION))


def hide_env(env: Mapping[str, Any], keys: Iterable[str] | None = None) -> dict[str, Any]:
    """``env`` with the values of ``keys`` (of every name when None) replaced by ``<hidden>``."""
    hidden = None if keys is None else set(keys)
    return {k: HIDDEN if hidden is None or k in hidden else v for k, v in env.items()}


def hide_spec_env(spec: Any) -> Any:
    """A command's ``spec`` with every value of its ``env`` hidden.

    Every value, not only the profile's names: the spec is a copy made when the command was,
    and the profile may have changed since, so the spec alone does not say which of its names
    came from the profile. What the control plane adds itself (threads, binding) is on the
    deployment's ``affinity_plan`` too."""
    if not isinstance(spec, Mapping) or not spec.get("env"):
        return spec
    env = spec["env"]
    return {**spec, "env": hide_env(env) if isinstance(env, Mapping) else HIDDEN}
