"""One completions request, from its arrival to the last byte of its answer.

Read top to bottom, this module is a request's path through the router:

1. ``serve``: the request arrives (``/v1/completions`` or ``/v1/chat/completions``). Its
   body is read and checked before any engine sees it (``_read_request``), its model picks
   the least-loaded replica (``_replica``) and the decider picks a route (``_plan``):
   gpu-only, PD, cpu-only, or turned away (``_rejected``). A request its deployment is too
   saturated to take waits in its SLO class's queue (``_route``, ``router.flow``) until
   it can be routed, is shed, or its wait runs out.
2. ``Serving.serve``: the route is served under the request's deadline, and whatever
   happens the outcome is counted.
3. ``Serving._until_served``: the route is tried (``_try``): gpu-only and cpu-only relay the
   engine's bytes untouched (``_passthrough``; a relayed stream whose engine dies is resumed
   on the other engine where the PD protocol allows it), PD hands the request to the
   deployment's PD protocol (``_run_pd``). A failure before any output moves the request to
   the next route on the same deployment (``_fallback``), else to another replica of its
   model (``_failover``); after output went out the stream ends with an error event
   (``_end_after``).
4. An engine that leaves the deployment set while the request waits on it hands the
   request over: its task is cancelled (``Serving.backend_removed``) and the cancellation
   becomes a ``BackendRemoved`` failure (``_handed_over``), served elsewhere as in 3.

The client's answer (headers, chunks, usage, TTFT and ITL) is ``router.client.stream``'s
``ClientStream``; the engines' HTTP client is ``router.engines.transport``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from common.policy_schema import MODES, PolicyKnobs, SloClass
from common.sse import event_data, split_events
from router.client.access import MODE_HEADER, allowed_mode_header
from router.client.classes import choose_class, strip_class_fields, with_priority
from router.client.errors import RouterError, saturated, unavailable
from router.client.stream import ClientGone, ClientRequest, ClientStream
from router.client.tenants import ANONYMOUS, REQUEST_TENANT, Admission, estimate_tokens
from router.client.validate import check_request, parse_body, strip_router_fields
from router.decide import Decision, Route, cpu_allowed, decide, hold_to_limits, retry_after_seconds
from router.engines.backends import Backend
from router.engines.deadlines import DEADLINES
from router.engines.transport import BackendRemoved, UpstreamFailed, request
from router.flow import Outcome, must_wait
from router.pd.registry import PROTOCOLS, PdProtocol
from router.pd.sequence import PdSequence
from router.state import Deployment, Router

log = logging.getLogger("syshax.router")

# Other replicas of the model a request may be moved to after failing before any output.
MAX_REPLICA_FAILOVERS = 2


async def serve(router: Router, http: web.Request) -> web.StreamResponse:
    """A completions request (chat or not), from its arrival to its last byte."""
    req = await _read_request(router, http)
    tenant = req.tenant or ANONYMOUS
    estimate = estimate_tokens(len(req.raw), req.max_tokens)
    admission = await router.tenants.admit_shared(tenant, req.model, estimate)
    try:
        deployment = _replica(router, req.model)
        decision, knobs = await _route(router, req, deployment)
    except RouterError as err:
        reason = TENANT_REJECTIONS.get(err.code or "")
        if reason is not None:
            router.tenants.reject(tenant, reason, admission)
        else:
            router.tenants.settle(admission, 0, 0, ok=False)
        raise
    except BaseException:
        router.tenants.settle(admission, 0, 0, ok=False)
        raise
    return await Serving(router, http, req, deployment, admission).serve(decision, knobs)


# -- 1. arrival: the request checked, its replica and its route ------------------------------


async def _read_request(router: Router, http: web.Request) -> ClientRequest:
    """The client's request, checked before any engine sees it: who may force a mode, the
    body's size, JSON and fields, the fields only the router sets, and its SLO class (a
    class its tenant may not use is refused and counted)."""
    received = time.perf_counter()
    chat = http.path.endswith("/chat/completions")
    config = router.config
    try:
        mode_header = allowed_mode_header(http.headers, config.mode_header, config.benchmark_keys)
    except RouterError as err:
        raise refuse(router, "mode-header", err) from None
    raw = await read_body(http, config.max_body_bytes)
    body = parse_body(raw)
    model, stream, include_usage, max_tokens = check_request(body, chat=chat)
    tenant = http.get(REQUEST_TENANT) or ANONYMOUS
    try:
        slo_class = choose_class(tenant, body, http.headers)
    except RouterError as err:
        if err.code == "class_not_allowed":
            router.tenants.reject(tenant, "class")
        raise
    # Every path sends these bytes (passthrough) or this body (PD, fallbacks, failover);
    # the engine's priority is added per deployment (``Serving._set_priority``).
    raw = without_router_fields(router, body, raw)
    if strip_class_fields(body):
        raw = json.dumps(body).encode()
    return ClientRequest(
        path=http.path,
        chat=chat,
        body=body,
        raw=raw,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        received_at=received,
        mode_header=mode_header,
        slo_class=slo_class,
        tenant=tenant,
    )


async def read_body(http: web.Request, limit: int) -> bytes:
    """The request's body; a 413 past ``limit`` bytes."""
    length = http.content_length
    if length is not None and length > limit:
        raise RouterError(
            413, f"request body is {length} bytes; the limit is {limit}", code="body_too_large"
        )
    try:
        return await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise RouterError(
            413, f"request body exceeds the limit of {limit} bytes", code="body_too_large"
        ) from None


def without_router_fields(router: Router, body: dict[str, Any], raw: bytes) -> bytes:
    """``raw`` without the router-only fields the client sent empty (``body`` loses them
    too; the bytes are encoded again only then). One that carries anything is a 400."""
    try:
        changed = strip_router_fields(body)
    except RouterError as err:
        raise refuse(router, "router-field", err) from None
    return json.dumps(body).encode() if changed else raw


def refuse(router: Router, reason: str, err: RouterError) -> RouterError:
    """A request turned away for asking what its client may not (a router-only field, a
    forced mode without a benchmark key, an engine path not listed): counted."""
    router.metrics.refusal(reason)
    return err


def _replica(router: Router, model: str) -> Deployment:
    """The least-loaded replica of ``model``; a 404 naming the served models."""
    deployment = router.state.choose(model)
    if deployment is None:
        raise unknown_model(router, model)
    return deployment


def unknown_model(router: Router, model: str) -> RouterError:
    """OpenAI's 404 for a model this router does not serve, naming the ones it does."""
    known = ", ".join(sorted(router.state.by_model)) or "none"
    return RouterError(
        404,
        f"The model '{model}' does not exist (served models: {known})",
        param="model",
        code="model_not_found",
    )


def _plan(
    router: Router, req: ClientRequest, deployment: Deployment, *, count: bool = True
) -> tuple[Decision, PolicyKnobs]:
    """The route for ``req`` on ``deployment``, and the knobs it was decided with; counted
    unless ``count`` is false (``_route`` counts the decision a request is finally given)."""
    base = router.state.policy_for(deployment).knobs
    req.knobs = forced_knobs(base, req.mode_header)
    knobs = req.knobs or base
    loads = deployment.loads(time.monotonic())
    # About four bytes of body a prompt token (the TPM estimate's), for the CPU's TTFT.
    prompt = estimate_tokens(len(req.raw), 0)
    decision = decide(knobs, loads, knobs.slo_class(req.slo_class), prompt_tokens=prompt)
    if decision.route is Route.PD and (req.body.get("n") or 1) > 1:
        # Splicing several choices across engines is not worth it; the GPU serves n > 1.
        decision = Decision(Route.GPU_ONLY, reason="n > 1", code="n-above-1")
    if decision.route is Route.PD and deployment.cpu is None:
        decision = Decision(Route.GPU_ONLY, reason="deployment has no CPU engine", code="no-cpu")
    if decision.route is Route.PD:
        why = _protocol(deployment).unspliceable(req.body)
        if why is not None:
            decision = Decision(Route.GPU_ONLY, reason=why, code="not-spliceable")
    if _forced(req):
        # A forced mode picks the device, never past the policy's hard limits.
        decision = hold_to_limits(decision, knobs, loads)
    if count:
        _count_decision(router, req, decision)
    return decision, knobs


def _count_decision(router: Router, req: ClientRequest, decision: Decision) -> None:
    router.metrics.decision("new", decision.route.value, decision.code)
    router.metrics.class_decision(req.slo_class, decision.route.value, decision.code)


# The flow control's refusals, by error code, as a tenant's usage counts them.
TENANT_REJECTIONS = {"shed": "shed", "queue_full": "shed", "queue_timeout": "queue-timeout"}


async def _route(
    router: Router, req: ClientRequest, deployment: Deployment
) -> tuple[Decision, PolicyKnobs]:
    """The route for ``req`` on ``deployment``, after a wait in its class's queue where the
    deployment is saturated (a 429 from the decider) or requests of its class or a higher
    one already wait there (docs/slo-classes.md, "Flow control"). A request that sets its
    mode (``X-Syshax-Mode``, benchmarks), or a policy with ``max_queue_size`` 0, never
    waits: it gets the decider's 429 at once, as before flow control."""
    decision, knobs = _plan(router, req, deployment, count=False)
    flow, key = router.flow, deployment.spec.id
    slo = knobs.slo_class(req.slo_class)
    tenant = (req.tenant or ANONYMOUS).name
    may_wait = req.mode_header is None and knobs.max_queue_size > 0
    queued_ahead = may_wait and flow.ahead(key, slo)
    if not (may_wait and (must_wait(decision) or queued_ahead)):
        _count_decision(router, req, decision)
        if decision.route is Route.REJECTED:
            raise _rejected(router, decision)
        flow.served(key, req.slo_class, tenant)
        return decision, knobs
    if decision.route is Route.REJECTED and not must_wait(decision):
        _count_decision(router, req, decision)
        raise _rejected(router, decision)  # no engine can serve it: waiting will not help
    waiter = flow.enqueue(
        key,
        slo,
        tenant,
        lambda: _plan(router, req, deployment, count=False)[0],
        bound=knobs.max_queue_size,
        max_wait=_max_wait(slo, knobs),
    )
    if queued_ahead:
        flow.pump(key)  # those ahead first; this one too, if there is room for it
    await flow.wait(waiter)
    knobs = router.state.knobs_for(deployment, req.knobs)
    if waiter.outcome is Outcome.FAILED:
        assert waiter.error is not None
        raise waiter.error
    if waiter.outcome is Outcome.SHED:
        shed = Decision(Route.REJECTED, reason=waiter.reason, status=429, code=waiter.reason)
        _count_decision(router, req, shed)
        router.metrics.count_request(Route.REJECTED.value, "rejected", req.model)
        raise _shed(waiter.reason, slo, knobs)
    routed = waiter.decision
    assert routed is not None
    _count_decision(router, req, routed)
    if routed.route is Route.REJECTED:
        raise _rejected(router, routed)
    return routed, knobs


def _max_wait(slo: SloClass, knobs: PolicyKnobs) -> float:
    """How long a request of class ``slo`` may wait: a sheddable class its TTFT target
    (past it the answer is late anyway), the others the whole request deadline."""
    return slo.ttft_ms / 1000.0 if slo.sheddable else knobs.request_timeout_seconds


def _shed(reason: str, slo: SloClass, knobs: PolicyKnobs) -> RouterError:
    """The 429 of a request flow control turned away (``reason``: router.flow's)."""
    full = (
        f"all engines are saturated and the router's queues are full "
        f"(max_queue_size {knobs.max_queue_size})"
    )
    if reason == "timeout":
        message = (
            f"the {slo.name} request waited {_max_wait(slo, knobs):g}s in the router's "
            "queue without an engine free to take it"
        )
        code = "queue_timeout"
    elif reason == "evicted":
        message = f"the {slo.name} request was shed from the full queue for a higher class"
        code = "shed"
    elif reason == "fair-share":
        message = (
            f"the {slo.name} request was shed from the full queue, where its tenant held the "
            "most requests, to make room for another tenant's"
        )
        code = "shed"
    elif slo.sheddable:
        message, code = f"{full}; the {slo.name} request was shed", "shed"
    else:
        message, code = full, "queue_full"
    return RouterError(
        429,
        message,
        type_="rate_limit_exceeded",
        code=code,
        retry_after=retry_after_seconds(knobs),
    )


def forced_knobs(base: PolicyKnobs, header: str | None) -> PolicyKnobs | None:
    """The policy with its mode forced by the X-Syshax-Mode header, so the benchmark's CPU,
    GPU and hetero modes run through one router on the same engines. ``auto`` forces the
    heterogeneous scheduler on (PD offload enabled) whatever the live policy says."""
    if header is None:
        return None
    mode = header.strip().lower()
    if mode not in MODES:
        raise RouterError(
            400,
            f"{MODE_HEADER} must be one of {', '.join(MODES)}; got {header!r}",
            param=MODE_HEADER,
            code="invalid_mode",
        )
    return replace(
        base,
        mode=mode,
        enable_auto_pd_offload=True if mode == "auto" else base.enable_auto_pd_offload,
    )


def _forced(req: ClientRequest) -> bool:
    """Whether the request pinned its route with X-Syshax-Mode (``auto`` pins nothing: the
    decider's own limits apply)."""
    return req.knobs is not None and req.knobs.mode != "auto"


def _protocol(deployment: Deployment) -> PdProtocol:
    """The deployment's PD wire protocol (its ``pd_protocol``, checked when it was parsed)."""
    return PROTOCOLS[deployment.spec.pd_protocol]


def _rejected(router: Router, decision: Decision) -> RouterError:
    """A request the decider turned away: counted, and a 429 or 503 with Retry-After."""
    router.metrics.count_request(Route.REJECTED.value, "rejected")
    retry = retry_after_seconds(router.state.default_policy().knobs)
    if decision.status == 429:
        return saturated(f"all engines are saturated: {decision.reason}", retry_after=retry)
    return unavailable(f"no engine can serve this request: {decision.reason}", retry_after=retry)


# -- 2-4. serving the route, falling back, failing over ----------------------------------------


class Serving:
    """One request while engines serve it: the deployment it is on, its answer's stream,
    the replicas tried, and the decision and outcome its count is labelled with.

    It is also the request as an engine counts it in flight (``Backend.holding``), so an
    engine leaving the deployment set can hand it over (``backend_removed``)."""

    # Set by ``_move_to``: the deployment serving the request, its PD protocol, the client's
    # stream, and the engine that left the deployment set while the request waited on it.
    deployment: Deployment
    pd: PdProtocol
    out: ClientStream
    removed_from: Backend | None

    def __init__(
        self,
        router: Router,
        http: web.Request,
        req: ClientRequest,
        deployment: Deployment,
        admission: Admission | None = None,
    ) -> None:
        self.router = router
        self.http = http
        self.req = req
        # The tenant's admission, settled with the tokens used when the request ends.
        self.admission = admission
        # The engine request's bytes before a deployment's priority is added.
        self.raw = req.raw
        # Usage a relayed non-streaming answer reported (prompt, completion).
        self.usage: tuple[int, int] | None = None
        self.metrics = router.metrics
        self.first_byte = router.config.timeouts.first_byte
        # Cancelled when the engine the request waits on leaves the deployment set.
        self.task = asyncio.current_task()
        self.tried: set[int] = set()
        self.failovers = 0
        self.label = ""  # the route last tried, the decision label of the request's count
        self.outcome = "error"
        self._move_to(deployment)

    def _move_to(self, deployment: Deployment) -> None:
        """Serve on ``deployment`` from now on, with a fresh stream (nothing was sent yet)."""
        self.deployment = deployment
        self.tried.add(deployment.spec.id)
        self.pd = _protocol(deployment)
        self.out = ClientStream(self.http, self.req, self.metrics)
        self.removed_from = None
        self._set_priority()

    def _set_priority(self) -> None:
        """The engine request carries the class's ``priority`` where the deployment's
        engines schedule by priority, and none elsewhere (vLLM refuses a non-zero one)."""
        req = self.req
        if not self.deployment.spec.priority_scheduling:
            if req.body.pop("priority", None) is not None:
                req.raw = self.raw
            return
        knobs = self.router.state.knobs_for(self.deployment, req.knobs)
        priority = knobs.slo_class(req.slo_class).priority
        req.body["priority"] = priority
        try:
            req.raw = with_priority(self.raw, priority)
        except ValueError:
            req.raw = json.dumps(req.body).encode()

    async def serve(self, decision: Decision, knobs: PolicyKnobs) -> web.StreamResponse:
        """Serve within the request deadline (``request_timeout_seconds``); the outcome is
        counted whatever happens: ok, error, client_error or cancelled."""
        self.label = decision.route.value
        # The deadline counts from the request's arrival: a wait in the queue is part of it.
        left = knobs.request_timeout_seconds - (time.perf_counter() - self.req.received_at)
        try:
            async with DEADLINES.cancel_after(max(0.001, left)):
                return await self._until_served(decision, knobs)
        except TimeoutError:
            if self.out.started:
                return await self.out.abort("request timed out", client_gone_ok=True)
            raise RouterError(
                504,
                f"request exceeded {knobs.request_timeout_seconds:g}s",
                type_="timeout",
                code="request_timeout",
            ) from None
        except ClientGone:
            self.outcome = "cancelled"
            return self.out.response or web.Response(status=499)
        except asyncio.CancelledError:
            self.outcome = "cancelled"
            raise
        finally:
            self.metrics.count_request(self.label, self.outcome, self.req.model)
            self._settle()
            # A request that ended may leave room for those waiting on its deployment.
            self.router.flow.pump(self.deployment.spec.id)

    def _settle(self) -> None:
        """The tenant's admission settled with the tokens the request used: the engines'
        usage where it was seen, else what the router counted (and estimated)."""
        if self.admission is None:
            return
        out = self.out
        if out.prompt_tokens or out.completion_tokens:
            prompt, completion = out.prompt_tokens, out.completion_tokens
        else:
            prompt, completion = self.usage or relayed_usage(out, len(self.raw))
        self.router.tenants.settle(self.admission, prompt, completion, ok=self.outcome == "ok")

    async def _until_served(self, decision: Decision, knobs: PolicyKnobs) -> web.StreamResponse:
        """Try routes until one answers: after a failure before any output, the next route
        on the same deployment, else another replica of the model."""
        while True:
            tried = await self._try(decision)
            if not isinstance(tried, UpstreamFailed):
                return tried
            failure = tried
            ended = await self._end_after(failure)
            if ended is not None:
                return ended
            decision = self._fallback(decision.route) or self._failover(failure, knobs)

    async def _try(self, decision: Decision) -> web.StreamResponse | UpstreamFailed:
        """Serve ``decision``'s route on the current deployment: the answer, or why the
        engines could not give it."""
        if decision.fallback:
            self.metrics.fallback(f"to-{decision.route.value}")
        self.label = self.out.decision_label = decision.route.value
        self.out.decision_reason = decision.code
        try:
            if decision.route is Route.PD:
                response = await self._run_pd(decision)
            else:
                response = await self._passthrough(self._engine(decision.route))
        except UpstreamFailed as exc:
            return exc
        except asyncio.CancelledError:
            removed = self._handed_over()
            if removed is None:
                raise
            return removed
        self.outcome = "ok" if response.status < 400 else "error"
        return response

    def _engine(self, route: Route) -> Backend:
        backend = self.deployment.gpu if route is Route.GPU_ONLY else self.deployment.cpu
        assert backend is not None
        return backend

    async def _passthrough(self, backend: Backend) -> web.StreamResponse:
        """gpu-only or cpu-only: the client's own bytes go up, the engine's bytes come back
        untouched. A stream cut short is resumed on the other engine where it can be."""
        out = self.out
        with backend.holding(self):
            try:
                async with request(
                    backend.pool, self.req.path, self.req.raw, first_byte=self.first_byte
                ) as resp:
                    await resp.raise_for_status()
                    if self.req.stream:
                        response = await out.pump(resp)
                    else:
                        body = await resp.read_all()
                        response = out.whole(body, resp.status, resp.content_type)
                        self.usage = answer_usage(body)
                backend.record_success()
                return response
            except UpstreamFailed as exc:
                self.record_failure(backend, exc)
                if out.response is None:
                    raise
                if await self.pd.resume(self._sequence(), backend, str(exc)):
                    return await out.finish()
                # Bytes already went out; end the stream with an error event, never a hang.
                return await out.abort(str(exc))

    async def _run_pd(self, decision: Decision) -> web.StreamResponse:
        """GPU prefill, then decode on the CPU with re-decisions, in the deployment's protocol."""
        await self.pd.run(self._sequence(), decision)
        return await self.out.finish()

    def _sequence(self) -> PdSequence:
        """What the deployment's PD protocol is given to serve this request."""
        deployment, state = self.deployment, self.router.state
        return PdSequence(
            req=self.req,
            out=self.out,
            gpu=deployment.gpu,
            cpu=deployment.cpu,
            deployment=deployment.spec.name,
            knobs=lambda: state.knobs_for(deployment, self.req.knobs),
            loads=lambda: deployment.loads(time.monotonic()),
            metrics=self.metrics,
            first_byte=self.first_byte,
            holder=self,
            record_failure=self.record_failure,
        )

    async def _end_after(self, failure: UpstreamFailed) -> web.StreamResponse | None:
        """The answer when ``failure`` ends the request: the engine's own 4xx (the client's
        request was at fault) before any output, or an error event once output went out.
        None: nothing was sent, so it may be served elsewhere."""
        if failure.client_error and not self.out.started:
            self.outcome = "client_error"
            return web.Response(
                status=failure.status or 400,
                body=failure.body or b"",
                content_type="application/json",
            )
        if self.out.started:
            return await self.out.abort(str(failure), client_gone_ok=True)
        return None

    def _fallback(self, failed: Route) -> Decision | None:
        """The next route on the same deployment after ``failed`` could not be served, or
        None when nothing is left there."""
        deployment, req = self.deployment, self.req
        # Read live: the policy may have changed while the failed route was being tried.
        knobs = self.router.state.knobs_for(deployment, req.knobs)
        now = time.monotonic()
        cpu_ok = deployment.cpu is not None and deployment.cpu.available(now)
        nxt = None
        if failed in (Route.GPU_ONLY, Route.PD) and cpu_ok and cpu_allowed(knobs):
            nxt = Decision(Route.CPU_ONLY, reason="GPU engine failed", fallback=True)
        elif (
            failed is Route.CPU_ONLY and deployment.gpu.available(now) and knobs.mode != "cpu-only"
        ):
            nxt = Decision(Route.GPU_ONLY, reason="CPU engine failed", fallback=True)
        if nxt is not None and _forced(req):
            nxt = hold_to_limits(nxt, knobs, deployment.loads(now))
        return nxt if nxt is not None and nxt.route is not Route.REJECTED else None

    def _failover(self, failure: UpstreamFailed, knobs: PolicyKnobs) -> Decision:
        """Move the request, which has sent nothing yet, to another replica of its model
        that would take it, and return the route decided there; a 503 when none is left."""
        replica = self._other_replica() if self.failovers < MAX_REPLICA_FAILOVERS else None
        if replica is None:
            raise unavailable(
                f"{failure}; no other engine can serve this request"
                + (f" ({self.failovers + 1} replicas tried)" if self.failovers else ""),
                retry_after=retry_after_seconds(knobs),
            )
        self.failovers += 1
        deployment, decision = replica
        self.metrics.failover(failure.reason)
        log.info(
            "request moves to deployment %s (%s): %s",
            deployment.spec.name,
            decision.route.value,
            failure,
        )
        self._move_to(deployment)
        return decision

    def _other_replica(self) -> tuple[Deployment, Decision] | None:
        """The least-loaded replica of the request's model not yet tried that would take it.
        A replica that would turn it away (down, saturated) is skipped; the PD pair of the
        one chosen is again that deployment's own two engines."""
        while True:
            candidate = self.router.state.choose(self.req.model, exclude=self.tried)
            if candidate is None:
                return None
            self.tried.add(candidate.spec.id)
            decision, _ = _plan(self.router, self.req, candidate)
            if decision.route is not Route.REJECTED:
                return candidate, decision

    def record_failure(self, backend: Backend, exc: UpstreamFailed) -> None:
        """Count ``backend``'s failure towards its errors and ejection, once; the engine's
        refusal of the client's own request (4xx) is not the engine's fault."""
        if exc.client_error or exc.recorded:
            return
        exc.recorded = True
        self.metrics.backend_error(backend.url, backend.role)
        if backend.record_failure(
            time.monotonic(),
            connect_failed=exc.connect_failed,
            may_eject=self.router.state.may_eject(backend),
        ):
            self.metrics.ejection(backend.url, backend.role)
        log.warning("upstream failure: %s", exc)

    # -- an engine leaving the deployment set ----------------------------------------------

    def backend_removed(self, backend: Backend) -> bool:
        """The engine this request is on left the deployment set. Unless output already
        went out, cancel the request's task: ``_try`` turns that cancellation into a
        ``BackendRemoved`` failure and the request is served elsewhere. A stream that
        already started stays where it is (``Backend.retire``)."""
        if self.out.started or self.removed_from is not None or self.task is None:
            return False
        self.removed_from = backend
        self.task.cancel()
        return True

    def _handed_over(self) -> BackendRemoved | None:
        """The failure to serve elsewhere when this cancellation is the one that
        ``backend_removed`` asked for; None when the task is (also) cancelled for another
        reason - the client left, or the request deadline passed."""
        backend = self.removed_from
        if backend is None:
            return None
        self.removed_from = None
        assert self.task is not None
        self.task.uncancel()
        if self.task.cancelling():
            return None
        return BackendRemoved(backend)


# -- usage of a relayed answer, for the tenant's token count --------------------------------


def _usage_pair(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion


def answer_usage(body: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of an engine's non-streaming answer; None if it has none."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return _usage_pair(data.get("usage")) if isinstance(data, dict) else None


def relayed_usage(out: ClientStream, body_bytes: int) -> tuple[int, int]:
    """(prompt, completion) tokens of a relayed stream: its usage chunk where the client
    asked for one (it may have left in a payload before the last), else the tokens counted
    from its events (their token ids where the engine sent them, else a token per text
    event of each choice) and the prompt estimated from the request's size."""
    last = b"".join(out.relayed[-2:]) + out.tail
    for payload in reversed(_payloads(last)[-3:]):
        if b'"usage"' not in payload:
            continue
        try:
            pair = _usage_pair(json.loads(payload).get("usage"))
        except (ValueError, AttributeError):
            pair = None
        if pair is not None:
            return pair
    events = _payloads(b"".join(out.relayed) + out.tail)
    return max(1, body_bytes // 4), sum(_event_tokens(payload) for payload in events)


def _payloads(stream: bytes) -> list[bytes]:
    """The data of each whole event in ``stream`` (a relayed stream from an event's start)."""
    return [
        payload
        for event in split_events(bytearray(stream), final=True)
        if (payload := event_data(event)) is not None and payload != b"[DONE]"
    ]


def _event_tokens(payload: bytes) -> int:
    """The completion tokens one relayed event carries, over all its choices."""
    try:
        choices = json.loads(payload).get("choices") or []
    except (ValueError, AttributeError):
        return 0
    tokens = 0
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            tokens += len(ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            tokens += 1
    return tokens
