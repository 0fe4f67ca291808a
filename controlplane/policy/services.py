"""Changing the live policy: atomic, versioned, audited."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from common.policy_schema import PolicyError, knob_errors, validate_knobs
from controlplane.core import audit
from controlplane.core.actors import Actor
from controlplane.core.services import checked_delete
from controlplane.policy.choices import PolicyAuditAction
from controlplane.policy.models import KNOB_NAMES, PolicyRevision, SchedulingPolicy


class NothingChanged(PolicyError):
    def __init__(self) -> None:
        super().__init__("policy", "the change sets every knob to its current value")


def _record_revision(
    policy: SchedulingPolicy,
    *,
    reason: str,
    acting_user: Actor,
    changed: dict[str, Any] | None = None,
    rolled_back_to: int | None = None,
) -> PolicyRevision:
    """Snapshot the policy's current version and knobs as a revision row."""
    user, label = audit.split_actor(acting_user)
    return PolicyRevision.objects.create(
        policy=policy,
        version=policy.version,
        knobs=policy.knobs(),
        changed=changed if changed is not None else {},
        reason=reason,
        created_by=user,
        created_by_label=label,
        rolled_back_to=rolled_back_to,
    )


def ensure_default_policy() -> SchedulingPolicy:
    policy, created = SchedulingPolicy.objects.get_or_create(name="default")
    if created:
        _record_revision(
            policy, reason="initial defaults (sysHAX example configuration)", acting_user=None
        )
    return policy


def create_policy(
    name: str, *, acting_user: Actor, reason: str, description: str = "", **knobs: Any
) -> SchedulingPolicy:
    validated = validate_knobs(knobs, partial=True)
    with transaction.atomic(durable=True):
        policy = SchedulingPolicy.objects.create(
            name=name, description=description, **validated.as_dict()
        )
        record_created(policy, acting_user=acting_user, reason=reason)
    return policy


def record_created(policy: SchedulingPolicy, *, acting_user: Actor, reason: str) -> PolicyRevision:
    """The first revision and the audit row for a policy that was just saved."""
    revision = _record_revision(policy, reason=reason, acting_user=acting_user)
    audit.record(PolicyAuditAction.POLICY_CREATED, policy, acting_user=acting_user)
    return revision


def _missing_reason(reason: str | None) -> PolicyError | None:
    if not reason or not reason.strip():
        return PolicyError("reason", "a reason is required for every policy change")
    return None


def change_errors(
    policy: SchedulingPolicy, *, changes: dict[str, Any], reason: str | None
) -> list[PolicyError]:
    """Every reason :func:`update_policy` would refuse this change, found at once (empty
    when it would save it): a missing reason and each bad knob, for a form to show together.
    A change that alters nothing is only found by saving it."""
    missing = _missing_reason(reason)
    return ([missing] if missing else []) + knob_errors({**policy.knobs(), **changes})


def update_policy(
    policy: SchedulingPolicy,
    *,
    changes: dict[str, Any],
    acting_user: Actor,
    reason: str,
    rolled_back_to: int | None = None,
) -> PolicyRevision:
    """Apply knob changes as a new revision. Raises PolicyError naming the bad knob."""
    if missing := _missing_reason(reason):
        raise missing
    with transaction.atomic():
        locked = SchedulingPolicy.objects.select_for_update().get(pk=policy.pk)
        current = locked.knobs()
        validated = validate_knobs({**current, **changes}).as_dict()
        diff = {k: [current[k], validated[k]] for k in KNOB_NAMES if current[k] != validated[k]}
        if not diff:
            raise NothingChanged()
        for key, (_, new) in diff.items():
            setattr(locked, key, new)
        locked.version += 1
        locked.save()
        revision = _record_revision(
            locked,
            reason=reason.strip(),
            acting_user=acting_user,
            changed=diff,
            rolled_back_to=rolled_back_to,
        )
        audit.record(
            PolicyAuditAction.POLICY_CHANGED,
            locked,
            acting_user=acting_user,
            detail={"version": locked.version, "changed": diff, "reason": reason},
        )
    policy.refresh_from_db()
    return revision


def rollback_policy(
    policy: SchedulingPolicy, *, to_version: int, acting_user: Actor, reason: str = ""
) -> PolicyRevision:
    """Restore an earlier revision's knobs as a new revision (history is never rewritten)."""
    try:
        target = policy.revisions.get(version=to_version)
    except PolicyRevision.DoesNotExist:
        raise PolicyError(
            "version", f"policy {policy.name!r} has no revision {to_version}"
        ) from None
    return update_policy(
        policy,
        changes=target.knobs,
        acting_user=acting_user,
        reason=reason or f"rollback to v{to_version}",
        rolled_back_to=to_version,
    )


def policy_delete_refusal(policy: SchedulingPolicy) -> str:
    """Why the policy may not be deleted, or "" (the deployments that use it protect it too,
    through their key: Django's ProtectedError names them)."""
    if policy.name == "default":
        return "the default policy cannot be deleted"
    return ""


def delete_policy(policy: SchedulingPolicy, *, acting_user: Actor) -> None:
    """Delete the policy and its revisions, with an audit row."""
    checked_delete(
        policy, policy_delete_refusal, PolicyAuditAction.POLICY_DELETED, acting_user=acting_user
    )
