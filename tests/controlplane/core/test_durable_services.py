"""A top-level service is its own unit of work: its outermost block is
``transaction.atomic(durable=True)``, so a caller that wraps it in a transaction of its own
(and would hold its writes, audit row included, hostage to whatever comes after) fails at
once (docs/architecture.md, "Where logic lives").

These tests run with ``transaction=True``: inside the ``db`` fixture's test transaction Django
lets durable blocks through, so the check would not be live."""

from __future__ import annotations

import pytest
from django.db import transaction

from controlplane.policy.models import SchedulingPolicy
from controlplane.policy.services import create_policy


@pytest.mark.django_db(transaction=True)
def test_a_durable_service_called_inside_another_transaction_raises_and_writes_nothing() -> None:
    with pytest.raises(RuntimeError, match="durable"), transaction.atomic():
        create_policy("nested", acting_user="test", reason="called inside a transaction")
    assert not SchedulingPolicy.objects.filter(name="nested").exists()


@pytest.mark.django_db(transaction=True)
def test_a_durable_service_called_on_its_own_commits() -> None:
    create_policy("alone", acting_user="test", reason="called on its own")
    assert SchedulingPolicy.objects.filter(name="alone").exists()
