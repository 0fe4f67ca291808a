"""One completions request, from its arrival to the last byte of its answer.

Read top to bottom, this module is a request's path through the router:

1. ``serve``: the request arrives (``/v1/completions`` or ``/v1/chat/completions``). Its
   body is read and checked before any engine sees it (``_read_request``), then
   ``router.plan`` gives its replica and its route by the decision pipeline
   (``router.decide.pipeline``): gpu-only, PD, cpu-only, or turned away. A request its
   deployment is too saturated to take waits in its SLO class's queue (``plan.route``,
   ``router.flow``) until it can be routed, is shed, or its wait runs out.
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
from typing import Any

from aiohttp import web

from common.policy_schema import PolicyKnobs
from common.tenants import TenantRecord
from router.client.access import allowed_mode_header
from router.client.classes import choose_class, strip_class_fields, with_priority
from router.client.errors import RouterError, unavailable
from router.client.stream import ClientGone, ClientRequest, ClientStream
from router.client.tenants import ANONYMOUS, REQUEST_TENANT, Admission, estimate_tokens
from router.client.usage import answer_usage, relayed_usage
from router.client.validate import check_request, parse_body, strip_router_fields
from router.decide import Decision, Mode, Route, cpu_allowed, hold_to_limits, retry_after_seconds
from router.engines.backends import Backend
from router.engines.deadlines import DEADLINES
from router.engines.transport import BackendRemoved, UpstreamFailed, request
from router.pd.registry import PdProtocol
from router.pd.sequence import PdSequence
from router.plan import forced, plan, protocol, replica, route
from router.state import Deployment, Router
from router.tracing import ADMISSION, NO_TRACE, RequestTrace, Step

log = logging.getLogger("syshax.router")

# Other replicas of the model a request may be moved to after failing before any output.
MAX_REPLICA_FAILOVERS = 2


async def serve(router: Router, http: web.Request) -> web.StreamResponse:
    """A completions request (chat or not), from its arrival to its last byte, traced as
    one server span when tracing is on (router.tracing)."""
    trace = router.tracer.begin(http)
    try:
        response = await _serve(router, http, trace)
    except RouterError as err:
        trace.finish(err.status, err.code or err.type_)
        raise
    except asyncio.CancelledError:
        trace.finish(499, "cancelled")
        raise
    except BaseException as exc:
        trace.finish(500, type(exc).__name__)
        raise
    trace.finish(response.status, None if response.status < 400 else str(response.status))
    return response


async def _serve(router: Router, http: web.Request, trace: RequestTrace) -> web.StreamResponse:
    req = await _read_request(router, http)
    tenant = req.tenant or ANONYMOUS
    estimate = estimate_tokens(len(req.raw), req.max_tokens)
    with trace.step(ADMISSION) as step:
        if trace.recording:
            _admission_attributes(step, req, tenant, estimate)
        admission = await router.tenants.admit_shared(tenant, req.model, estimate)
    try:
        deployment = replica(router, req)
        decision, knobs = await route(router, req, deployment, trace)
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
    serving = Serving(router, http, req, deployment, admission, trace)
    return await serving.serve(decision, knobs)


def _admission_attributes(
    step: Step, req: ClientRequest, tenant: TenantRecord, estimate: int
) -> None:
    """What a trace says of a request's admission: its tenant's name and limits, its class,
    model and estimated tokens (never a key or a prompt)."""
    step.set("syshax.tenant", tenant.name)
    step.set("syshax.slo_class", req.slo_class)
    step.set("syshax.model", req.model)
    step.set("syshax.tenant.rpm_limit", tenant.rpm_limit)
    step.set("syshax.tenant.tpm_limit", tenant.tpm_limit)
    step.set("syshax.tokens.estimate", estimate)
    step.set("syshax.stream", req.stream)


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


# The flow control's refusals, by error code, as a tenant's usage counts them.
TENANT_REJECTIONS = {"shed": "shed", "queue_full": "shed", "queue_timeout": "queue-timeout"}


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
        trace: RequestTrace = NO_TRACE,
    ) -> None:
        self.router = router
        self.trace = trace
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
        self.pd = protocol(deployment)
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
            if self.trace.recording:
                self._traced()
            self._settle()
            # A request that ended may leave room for those waiting on its deployment.
            self.router.flow.pump(self.deployment.spec.id)

    def _traced(self) -> None:
        """What the request's server span says of how it was served."""
        trace, out = self.trace, self.out
        trace.set("syshax.route", self.label)
        trace.set("syshax.outcome", self.outcome)
        trace.set("syshax.deployment", self.deployment.spec.name)
        trace.set("syshax.failovers", self.failovers)
        trace.set("gen_ai.response.id", out.request_id)
        trace.set("gen_ai.usage.prompt_tokens", out.prompt_tokens)
        trace.set("gen_ai.usage.completion_tokens", out.completion_tokens)

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
                call = "fallback" if decision.fallback else "passthrough"
                response = await self._passthrough(self._engine(decision.route), call)
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

    async def _passthrough(self, backend: Backend, call: str) -> web.StreamResponse:
        """gpu-only or cpu-only: the client's own bytes go up, the engine's bytes come back
        untouched. A stream cut short is resumed on the other engine where it can be."""
        out, req = self.out, self.req
        with backend.holding(self):
            try:
                with self.trace.engine_call(backend.role, backend.url, call) as span:
                    async with request(
                        backend.pool,
                        req.path,
                        req.raw,
                        first_byte=self.first_byte,
                        headers=span.headers,
                    ) as resp:
                        await resp.raise_for_status()
                        if req.stream:
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
            trace=self.trace,
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
            failed is Route.CPU_ONLY
            and deployment.gpu.available(now)
            and knobs.mode != Mode.CPU_ONLY
        ):
            nxt = Decision(Route.GPU_ONLY, reason="CPU engine failed", fallback=True)
        if nxt is not None and forced(req):
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
            candidate = self.router.state.choose(
                self.req.model, exclude=self.tried, body=self.req.body
            )
            if candidate is None:
                return None
            self.tried.add(candidate.spec.id)
            decision, _ = plan(self.router, self.req, candidate)
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
