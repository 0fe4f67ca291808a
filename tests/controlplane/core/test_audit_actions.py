"""Audit actions are enumerations in each app's choices.py (docs/decisions/0072-typed-seams.md):
one value names one action across the whole control plane, and a row stores the plain string,
so rows written before the enumerations and the filters that read them keep working."""

from __future__ import annotations

import pytest
from django.db import models

from controlplane.access.choices import AccessAuditAction
from controlplane.batches.choices import BatchAuditAction
from controlplane.benchmarks.choices import BenchmarkAuditAction
from controlplane.core import audit
from controlplane.core.models import AuditEntry
from controlplane.deployments.choices import CommandStatus, DeploymentAuditAction
from controlplane.inventory.choices import InventoryAuditAction
from controlplane.policy.choices import PolicyAuditAction
from controlplane.policy.services import create_policy
from controlplane.tenants.choices import TenantAuditAction

AUDIT_ACTIONS: list[type[models.TextChoices]] = [
    AccessAuditAction,
    BatchAuditAction,
    BenchmarkAuditAction,
    DeploymentAuditAction,
    InventoryAuditAction,
    PolicyAuditAction,
    TenantAuditAction,
]


def test_no_two_apps_name_the_same_action() -> None:
    values = [member.value for actions in AUDIT_ACTIONS for member in actions]
    assert len(values) == len(set(values))


def test_every_final_command_status_has_its_action() -> None:
    final = [status for status in CommandStatus if status != CommandStatus.QUEUED]
    for status in final:
        assert DeploymentAuditAction(f"command.{status}").value == f"command.{status}"


@pytest.mark.django_db
def test_a_row_stores_the_actions_plain_string_and_its_actor() -> None:
    policy = create_policy("audited", acting_user="scheduler", reason="a test")
    audit.record(PolicyAuditAction.POLICY_CHANGED, policy, acting_user=None)

    rows = AuditEntry.objects.filter(object_id=str(policy.pk)).order_by("pk")
    assert list(rows.values_list("action", "actor_label")) == [
        ("policy.created", "scheduler"),
        ("policy.changed", "system"),
    ]
    assert type(rows.values_list("action", flat=True)[1]) is str
