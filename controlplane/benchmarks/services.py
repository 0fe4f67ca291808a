from __future__ import annotations

from collections.abc import Collection
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q

from controlplane.benchmarks.analysis import compare_to_baseline
from controlplane.benchmarks.choices import (
    ACTIVE_STATUSES,
    CANCELLING,
    EXECUTE_RUN_TASK,
    BenchmarkAuditAction,
    RunStatus,
)
from controlplane.benchmarks.models import BenchmarkRun, Scenario
from controlplane.core import audit, dispatch
from controlplane.core.actors import Actor
from controlplane.core.services import checked_delete
from controlplane.deployments.models import Deployment
from controlplane.inventory.models import engine_host
from controlplane.routers import destinations

ADVISOR_RUNS = 20  # the mode advisor's window: the newest successful runs


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _endpoint(url: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    host = (parts.hostname or "").lower()
    return ("127.0.0.1" if host in LOOPBACK else host, port) if host else None


def known_targets() -> set[tuple[str, int]]:
    """Where a benchmark may send its load: the configured routers (ROUTER_URLS), the engines
    of the deployments, and what the operator lists in BENCHMARK_ALLOWED_TARGETS (``host`` for
    any port of it, ``host:port`` for one); port 0 stands for any port."""

    known: set[tuple[str, int]] = set()
    for raw in settings.BENCHMARK_ALLOWED_TARGETS:
        entry = raw.strip().lower()
        host, sep, port = entry.rpartition(":")
        if not sep or not port.isdigit():
            host, port = entry, "0"
        known.add(("127.0.0.1" if host in LOOPBACK else host, int(port)))
    # The configured routers, not the addresses routers report: any router token can
    # register one (docs/decisions/0056-router-destinations-configured.md).
    for url in destinations.configured_urls():
        if endpoint := _endpoint(url):
            known.add(endpoint)
    for address, gpu, cpu in Deployment.objects.values_list(
        "node__address", "profile__gpu_port", "profile__cpu_port"
    ):
        host = engine_host(address).lower()  # a stored address that is not a host: none
        host = "127.0.0.1" if host in LOOPBACK else host
        known |= {(host, gpu), (host, cpu)}
    return known


def check_target(url: str) -> None:
    """Refuse a target that is not one of this fleet's routers or engines, so a benchmark can
    never be aimed at another service the worker can reach."""
    endpoint = _endpoint(url)
    if endpoint is None:
        raise ValidationError({"target_url": f"{url!r} is not an http(s)://HOST:PORT URL"})
    known = known_targets()
    if endpoint in known or (endpoint[0], 0) in known:
        return
    raise ValidationError(
        {
            "target_url": f"{endpoint[0]}:{endpoint[1]} is neither a configured router "
            "(ROUTER_URLS) nor a deployment's engine; an operator can allow it in "
            "BENCHMARK_ALLOWED_TARGETS"
        }
    )


def create_run(*, acting_user: Actor, **fields: Any) -> BenchmarkRun:
    """Create a run and queue it once the row is committed."""
    if fields.get("target_url"):
        check_target(str(fields["target_url"]))
    with transaction.atomic(durable=True):
        run = BenchmarkRun(**fields)
        user, _ = audit.split_actor(acting_user)
        if user is not None:
            run.created_by = user
        run.full_clean()
        run.save()
        audit.record(BenchmarkAuditAction.RUN_CREATED, run, acting_user=acting_user)
        queue_run(run)
    return run


def run_errors(*, exclude: Collection[str] = (), **fields: Any) -> dict[str, list[str]]:
    """Every reason :func:`create_run` would refuse a run of ``fields``, found at once (empty
    when it would create it): its target and each field of its ``full_clean()``, for a form to
    show together. ``exclude`` names fields whose values the caller could not read."""
    errors: dict[str, list[str]] = {}
    checks = [lambda: BenchmarkRun(**fields).full_clean(exclude=list(exclude))]
    if fields.get("target_url") and "target_url" not in exclude:
        checks.insert(0, lambda: check_target(str(fields["target_url"])))
    for check in checks:
        try:
            check()
        except ValidationError as exc:
            for field, messages in exc.message_dict.items():
                if field not in exclude:
                    errors.setdefault(field, []).extend(messages)
    return errors


def queue_run(run: BenchmarkRun) -> None:
    dispatch.enqueue(EXECUTE_RUN_TASK, run.pk)


def request_cancel(run: BenchmarkRun, *, acting_user: Actor) -> BenchmarkRun:
    """Queued runs cancel at once; a running one stops at its next progress check."""
    with transaction.atomic(durable=True):
        locked = BenchmarkRun.objects.select_for_update().get(pk=run.pk)
        if locked.status not in ACTIVE_STATUSES:
            return locked
        locked.cancel_requested = True
        if locked.status == RunStatus.QUEUED:
            locked.status = RunStatus.CANCELLED
        locked.save(update_fields=["cancel_requested", "status"])
        audit.record(BenchmarkAuditAction.RUN_CANCEL, locked, acting_user=acting_user)
    return locked


def baseline_for(run: BenchmarkRun) -> BenchmarkRun | None:
    """The deployment's baseline run of the same scenario (the newest marked baseline)."""
    if run.deployment_id is None:
        return None
    return (
        BenchmarkRun.objects.filter(
            deployment_id=run.deployment_id,
            scenario_id=run.scenario_id,
            is_baseline=True,
            status=RunStatus.SUCCEEDED,
        )
        .exclude(pk=run.pk)
        .order_by("-finished_at")
        .first()
    )


def flag_regression(run: BenchmarkRun, threshold_percent: float) -> bool:
    """Compare a finished run with its baseline and record the verdict on the run."""

    baseline = baseline_for(run)
    if baseline is None:
        run.regression = False
        run.regression_detail = {"baseline": None, "note": "no baseline run to compare with"}
    else:
        changes = compare_to_baseline(run.summary, baseline.summary, threshold_percent)
        run.regression = bool(changes)
        run.regression_detail = {
            "baseline": baseline.pk,
            "threshold_percent": threshold_percent,
            "changes": [change.__dict__ for change in changes],
        }
    run.save(update_fields=["regression", "regression_detail"])
    return run.regression


def advisor_summaries(
    deployment_id: int | None = None, limit: int = ADVISOR_RUNS
) -> list[dict[str, Any]]:
    """The summaries the mode advisor decides from: the newest ``limit`` runs that measured
    something (of one deployment if given), oldest first: the successful ones, and those
    cancelled or failed after finishing some points, marked partial. Each carries a ``run``
    entry (``id``, ``partial``, ``label``, ``recorded_under``) for the advisor's caveats."""
    runs = BenchmarkRun.objects.filter(
        Q(status=RunStatus.SUCCEEDED)
        | Q(status__in=(RunStatus.CANCELLED, RunStatus.FAILED), points_done__gt=0)
    ).order_by("-finished_at")
    if deployment_id is not None:
        runs = runs.filter(deployment_id=deployment_id)
    out = []
    for run in reversed(list(runs[:limit])):
        summary = dict(run.summary) if isinstance(run.summary, dict) else {}
        summary["run"] = {
            "id": run.pk,
            "partial": run.partial,
            "label": run.phase if run.partial else "",
            "recorded_under": run.recorded_under,
        }
        out.append(summary)
    return out


def cancel_message(run: BenchmarkRun) -> str:
    """What an operator is told after pressing Cancel, from the run's one state."""
    if run.state == CANCELLING:
        return (
            f"run {run.pk} is cancelling: it stops within a second and keeps the points it finished"
        )
    return f"run {run.pk} is {run.state}"


def scenario_delete_refusal(scenario: Scenario) -> str:
    """Why the scenario may not be deleted, or "" (its runs protect it too, through their
    key: Django's ProtectedError names them)."""
    if scenario.builtin:
        return f"{scenario.name!r} is built in and cannot be deleted"
    return ""


def delete_scenario(scenario: Scenario, *, acting_user: Actor) -> None:
    """Delete a scenario no run used, with an audit row."""
    checked_delete(
        scenario,
        scenario_delete_refusal,
        BenchmarkAuditAction.SCENARIO_DELETED,
        acting_user=acting_user,
    )


def run_delete_refusal(run: BenchmarkRun) -> str:
    """Why the run may not be deleted, or "": a queued or running one is a worker's to finish
    (cancel it first; a cancelled run keeps what it measured)."""
    if run.status in ACTIVE_STATUSES:
        return f"cannot delete benchmark run {run.pk} while it is {run.status}; cancel it first"
    return ""


def delete_run(run: BenchmarkRun, *, acting_user: Actor) -> None:
    """Delete a finished run and its samples, with an audit row."""
    checked_delete(
        run,
        run_delete_refusal,
        BenchmarkAuditAction.RUN_DELETED,
        acting_user=acting_user,
        detail=lambda r: {"status": r.status, "mode": r.mode},
    )
