"""A request's route: its replica, the decision pipeline's verdict on it
(``router.decide.pipeline``), and a wait in its SLO class's queue where its deployment is
too saturated to take it now (``router.flow``).

The rules themselves are the pipeline's steps; this module gathers what they ask of the
request and its deployment (an ``Ask``: the live policy or the mode the request forced,
the engines' loads, its class, prompt and ``n``, the deployment's CPU engine and PD
protocol), and counts the decision each request is finally given.
"""

from __future__ import annotations

import time
from dataclasses import replace

from common.decisions import Code, Mode, Route, Stage
from common.policy_schema import MODES, PolicyKnobs, SloClass
from router.client.access import MODE_HEADER
from router.client.errors import RouterError, saturated, unavailable
from router.client.stream import ClientRequest
from router.client.tenants import ANONYMOUS, estimate_tokens
from router.decide import NEW_REQUEST, Ask, Decision, retry_after_seconds
from router.flow import Outcome, must_wait
from router.pd.registry import PROTOCOLS, PdProtocol
from router.state import Deployment, Router
from router.tracing import DECISION, FLOW_WAIT, NO_STEP, NO_TRACE, RequestTrace, Step


def replica(router: Router, req: ClientRequest) -> Deployment:
    """The replica of the request's model the replica choice picks (least loaded, or holding
    its prompt's prefix); a 404 naming the served models."""
    deployment = router.state.choose(req.model, body=req.body)
    if deployment is None:
        raise unknown_model(router, req.model)
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


def plan(
    router: Router, req: ClientRequest, deployment: Deployment, *, count: bool = True
) -> tuple[Decision, PolicyKnobs]:
    """The route for ``req`` on ``deployment`` by the decision pipeline
    (``router.decide.pipeline.NEW_REQUEST``), and the knobs it was decided with; counted
    unless ``count`` is false (``route`` counts the decision a request is finally given)."""
    base = router.state.policy_for(deployment).knobs
    req.knobs = forced_knobs(base, req.mode_header)
    knobs = req.knobs or base
    ask = Ask(
        knobs,
        deployment.loads(time.monotonic()),
        knobs.slo_class(req.slo_class),
        # About four bytes of body a prompt token (the TPM estimate's), for the CPU's TTFT.
        prompt_tokens=estimate_tokens(len(req.raw), 0),
        choices=req.body.get("n") or 1,
        has_cpu=deployment.cpu is not None,
        unspliceable=lambda: protocol(deployment).unspliceable(req.body),
        forced=forced(req),
    )
    decision, req.decided_by = NEW_REQUEST.judge(ask)
    if count:
        count_decision(router, req, decision)
    return decision, knobs


def count_decision(
    router: Router, req: ClientRequest, decision: Decision, step: Step = NO_STEP
) -> None:
    """Count the decision ``req`` is finally given, and record it on its trace's step."""
    router.metrics.decision(Stage.NEW, decision.route, decision.code)
    router.metrics.class_decision(req.slo_class, decision.route, decision.code)
    if step is not NO_STEP:
        step.set("syshax.route", decision.route.value)
        step.set("syshax.decision.code", str(decision.code))
        step.set("syshax.decision.reason", decision.reason)
        step.set("syshax.decision.step", req.decided_by)


async def route(
    router: Router, req: ClientRequest, deployment: Deployment, trace: RequestTrace = NO_TRACE
) -> tuple[Decision, PolicyKnobs]:
    """The route for ``req`` on ``deployment``, after a wait in its class's queue where the
    deployment is saturated (a 429 from the decider) or requests of its class or a higher
    one already wait there (docs/slo-classes.md, "Flow control"). A request that sets its
    mode (``X-Syshax-Mode``, benchmarks), or a policy with ``max_queue_size`` 0, never
    waits: it gets the decider's 429 at once, as before flow control. Traced as the
    ``decision`` step (and a ``flow-control wait`` step where it waited)."""
    with trace.step(DECISION, {"syshax.deployment": deployment.spec.name}) as step:
        return await _route(router, req, deployment, trace, step)


async def _route(
    router: Router, req: ClientRequest, deployment: Deployment, trace: RequestTrace, step: Step
) -> tuple[Decision, PolicyKnobs]:
    decision, knobs = plan(router, req, deployment, count=False)
    flow, key = router.flow, deployment.spec.id
    slo = knobs.slo_class(req.slo_class)
    tenant = (req.tenant or ANONYMOUS).name
    may_wait = req.mode_header is None and knobs.max_queue_size > 0
    queued_ahead = may_wait and flow.ahead(key, slo)
    if not (may_wait and (must_wait(decision) or queued_ahead)):
        count_decision(router, req, decision, step)
        if decision.route is Route.REJECTED:
            raise rejected(router, decision)
        flow.served(key, req.slo_class, tenant)
        return decision, knobs
    if decision.route is Route.REJECTED and not must_wait(decision):
        count_decision(router, req, decision, step)
        raise rejected(router, decision)  # no engine can serve it: waiting will not help
    waiter = flow.enqueue(
        key,
        slo,
        tenant,
        lambda: plan(router, req, deployment, count=False)[0],
        bound=knobs.max_queue_size,
        max_wait=max_wait(slo, knobs),
    )
    if queued_ahead:
        flow.pump(key)  # those ahead first; this one too, if there is room for it
    with trace.step(FLOW_WAIT, {"syshax.slo_class": slo.name}) as waited:
        await flow.wait(waiter)
        waited.set("syshax.flow.outcome", str(waiter.outcome))
    knobs = router.state.knobs_for(deployment, req.knobs)
    if waiter.outcome is Outcome.FAILED:
        assert waiter.error is not None
        raise waiter.error
    if waiter.outcome is Outcome.SHED:
        shed = Decision(Route.REJECTED, reason=waiter.reason, status=429, code=waiter.reason)
        count_decision(router, req, shed, step)
        router.metrics.count_request(Route.REJECTED, "rejected", req.model)
        raise shed_error(waiter.reason, slo, knobs)
    routed = waiter.decision
    assert routed is not None
    count_decision(router, req, routed, step)
    if routed.route is Route.REJECTED:
        raise rejected(router, routed)
    return routed, knobs


def max_wait(slo: SloClass, knobs: PolicyKnobs) -> float:
    """How long a request of class ``slo`` may wait: a sheddable class its TTFT target
    (past it the answer is late anyway), the others the whole request deadline."""
    return slo.ttft_ms / 1000.0 if slo.sheddable else knobs.request_timeout_seconds


def shed_error(reason: Code | str, slo: SloClass, knobs: PolicyKnobs) -> RouterError:
    """The 429 of a request flow control turned away (``reason``: router.flow's)."""
    full = (
        f"all engines are saturated and the router's queues are full "
        f"(max_queue_size {knobs.max_queue_size})"
    )
    if reason == Code.TIMEOUT:
        message = (
            f"the {slo.name} request waited {max_wait(slo, knobs):g}s in the router's "
            "queue without an engine free to take it"
        )
        code = "queue_timeout"
    elif reason == Code.EVICTED:
        message = f"the {slo.name} request was shed from the full queue for a higher class"
        code = "shed"
    elif reason == Code.FAIR_SHARE:
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
        enable_auto_pd_offload=True if mode == Mode.AUTO else base.enable_auto_pd_offload,
    )


def forced(req: ClientRequest) -> bool:
    """Whether the request pinned its route with X-Syshax-Mode (``auto`` pins nothing: the
    decider's own limits apply)."""
    return req.knobs is not None and req.knobs.mode != Mode.AUTO


def protocol(deployment: Deployment) -> PdProtocol:
    """The deployment's PD wire protocol (its ``pd_protocol``, checked when it was parsed)."""
    return PROTOCOLS[deployment.spec.pd_protocol]


def rejected(router: Router, decision: Decision) -> RouterError:
    """A request the decider turned away: counted, and a 429 or 503 with Retry-After."""
    router.metrics.count_request(Route.REJECTED, "rejected")
    retry = retry_after_seconds(router.state.default_policy().knobs)
    if decision.status == 429:
        return saturated(f"all engines are saturated: {decision.reason}", retry_after=retry)
    return unavailable(f"no engine can serve this request: {decision.reason}", retry_after=retry)
