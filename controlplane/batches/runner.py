"""Run a batch: its pending lines through a router, a few at a time, at the batch class.

The task may be delivered twice and a worker may die mid-batch; neither runs a finished line
again. The worker takes the batch's lease (``services.claim``) or leaves it to the worker that
holds it, renews it as lines finish, and stores each line's result in a transaction of its
own as soon as it arrives. It sends only lines still pending, so a new worker after a crash
picks up where the dead one stopped (a line under way when it died runs again: its answer
was never stored). The threads only talk HTTP; every database write is on the task's own
thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
)

from common.tenants import ROUTER_KEY_TENANT
from controlplane.batches import services
from controlplane.batches.auth import TENANT_HEADER
from controlplane.batches.choices import BatchStatus
from controlplane.batches.models import Batch, BatchLine
from controlplane.routers import destinations
from controlplane.tenants.choices import RESERVED_NAMES

log = logging.getLogger(__name__)

# Answers worth another try: the router or its engines are busy or briefly away.
RETRIED = frozenset({429, 502, 503, 504})
MAX_BACKOFF_SECONDS = 60.0


def router_url() -> str | None:
    """Where batch lines go: ``BATCH_ROUTER_URL``, else a configured router (``ROUTER_URLS``;
    one that is alive first). Never a registered router's reported address: the lines carry
    the router key and other tenants' prompts (docs/decisions/0056-router-destinations-
    configured.md)."""
    if settings.BATCH_ROUTER_URL:
        return str(settings.BATCH_ROUTER_URL).rstrip("/")
    destination = destinations.pick()
    return destination.url if destination is not None else None


def request_headers(owner: str) -> dict[str, str]:
    """The router's own key, acting as the batch's tenant. Callers the routers name
    themselves (their own key, an open router's anonymous callers) are served as they were."""
    headers = {"Content-Type": "application/json"}
    if settings.ROUTER_API_KEY:
        headers["Authorization"] = f"Bearer {settings.ROUTER_API_KEY}"
    if owner not in RESERVED_NAMES and owner != ROUTER_KEY_TENANT:
        headers[TENANT_HEADER] = owner
    return headers


@dataclass(frozen=True)
class Outcome:
    ok: bool
    response: dict[str, Any] | None
    error: dict[str, Any] | None


def _retry_after(response: httpx.Response, attempt: int) -> float:
    try:
        given = float(response.headers.get("Retry-After", ""))
    except ValueError:
        given = 2.0**attempt
    return min(max(given, 0.0), MAX_BACKOFF_SECONDS)


def _busy(response: httpx.Response) -> bool:
    return response.status_code in RETRIED


def _pause(state: RetryCallState) -> float:
    """The wait before the next try: a busy answer's Retry-After, else 1, 2, 4 ... s (at most
    ``MAX_BACKOFF_SECONDS``)."""
    attempt = state.attempt_number - 1
    assert state.outcome is not None
    if state.outcome.failed:
        return min(2.0**attempt, MAX_BACKOFF_SECONDS)
    return _retry_after(state.outcome.result(), attempt)


def _last_answer(state: RetryCallState) -> httpx.Response:
    """Out of tries: the last answer, or the last transport error raised."""
    assert state.outcome is not None
    response: httpx.Response = state.outcome.result()
    return response


def call(
    client: httpx.Client,
    url: str,
    headers: dict[str, str],
    line: BatchLine,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """One line to the router, at the batch class; 429 and 502-504 are tried again (after
    the router's Retry-After), and so is a router that does not answer, up to
    ``BATCH_MAX_ATTEMPTS`` tries."""
    body = dict(line.body or {})
    body["service_tier"] = "flex"
    body["stream"] = False
    retrying = Retrying(
        stop=stop_after_attempt(settings.BATCH_MAX_ATTEMPTS),
        retry=retry_if_exception_type(httpx.HTTPError) | retry_if_result(_busy),
        wait=_pause,
        sleep=sleep,
        retry_error_callback=_last_answer,
    )
    try:
        response = retrying(client.post, url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        message = f"the router at {url} did not answer: {exc}"
        return Outcome(False, None, {"code": "router_unreachable", "message": message})
    return _outcome(response, line)


def _outcome(response: httpx.Response, line: BatchLine) -> Outcome:
    try:
        answer: Any = response.json()
    except ValueError:
        answer = {"text": response.text[:2000]}
    request_id = response.headers.get("X-Request-Id") or line.request_id
    stored = {"status_code": response.status_code, "request_id": request_id, "body": answer}
    if 200 <= response.status_code < 300:
        return Outcome(True, stored, None)
    detail = answer.get("error") if isinstance(answer, dict) else None
    message = (
        detail.get("message") if isinstance(detail, dict) else None
    ) or f"the router answered {response.status_code}"
    code = (detail.get("code") if isinstance(detail, dict) else None) or "request_failed"
    return Outcome(False, stored, {"code": code, "message": message})


def execute(batch_id: str) -> str:
    """The task's body: validate, run the pending lines, finish. Returns what it did."""
    worker = f"{uuid.uuid4().hex[:12]}"
    if not services.claim(batch_id, worker):
        return "held by another worker"  # or no such batch: nothing to do either way
    try:
        services.validate(batch_id)
        batch = Batch.objects.get(pk=batch_id)
        if batch.status == BatchStatus.IN_PROGRESS and batch.expires_at > timezone.now():
            url = router_url()
            if url is None:
                log.warning(
                    "batch %s waits: no router to send its lines to (set ROUTER_URLS or "
                    "BATCH_ROUTER_URL)",
                    batch_id,
                )
                return "waiting for a router"
            if not _run_lines(batch, url + batch.endpoint, worker):
                return "lease lost"
        return services.finish(batch_id)
    finally:
        services.release(batch_id, worker)


def _still_running(batch_id: str) -> bool:
    row = Batch.objects.filter(pk=batch_id).values_list("status", "expires_at").first()
    return row is not None and row[0] == BatchStatus.IN_PROGRESS and row[1] > timezone.now()


def _run_lines(batch: Batch, url: str, worker: str) -> bool:
    """Send the pending lines, at most ``BATCH_CONCURRENCY`` at once, until none is left or
    the batch stops running (cancelled, expired); the lines under way always finish and are
    stored. False if the lease was lost (another worker took the batch over)."""
    headers = request_headers(batch.owner)
    pending: Iterator[BatchLine] = services.pending_lines(batch.id)
    width = settings.BATCH_CONCURRENCY
    renew_every = settings.BATCH_LEASE_SECONDS / 3
    timeout = httpx.Timeout(settings.BATCH_REQUEST_TIMEOUT_SECONDS, connect=10.0)
    taking = True
    held = True
    with httpx.Client(timeout=timeout) as client, ThreadPoolExecutor(width) as pool:
        inflight: dict[Future[Outcome], BatchLine] = {}
        while True:
            while taking and len(inflight) < width:
                line = next(pending, None)
                if line is None:
                    taking = False
                    break
                inflight[pool.submit(call, client, url, headers, line)] = line
            if not inflight:
                return held
            done, _ = wait(inflight, timeout=renew_every, return_when=FIRST_COMPLETED)
            for future in done:
                line = inflight.pop(future)
                try:
                    outcome = future.result()
                except Exception:  # a bug: the line fails, named, and the batch goes on
                    log.exception("batch %s line %s failed in the worker", batch.id, line.line_no)
                    error = {"code": "internal_error", "message": "the batch worker failed"}
                    outcome = Outcome(False, None, error)
                services.record_result(
                    line, ok=outcome.ok, response=outcome.response, error=outcome.error
                )
            if not services.renew(batch.id, worker):
                held = taking = False
            elif taking and not _still_running(batch.id):
                taking = False
