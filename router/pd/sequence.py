"""What a PD protocol is given for one request, and nothing more: ``PdSequence``.

The request path (``router.request``) builds one for each request it hands to a protocol
(``run``: a PD route; ``resume``: a relayed stream whose engine died). It names the client's
request and the stream its answer goes to, the deployment's two engines, the live policy
and loads for the re-decisions at chunk boundaries, the metrics, and how an engine failure
is counted. A protocol reaches nothing else of the router.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.policy_schema import PolicyKnobs, SloClass
from router.client.stream import ClientRequest, ClientStream
from router.decide import Loads, cpu_allowed
from router.engines.backends import Backend, InFlight
from router.engines.transport import UpstreamFailed, call_json
from router.metrics import RouterMetrics
from router.tracing import NO_TRACE, RequestTrace


@dataclass(frozen=True)
class PdSequence:
    """One client request served across a deployment's engines."""

    # What the client asked (read only) and where its answer goes.
    req: ClientRequest
    out: ClientStream
    # The deployment's engines, and its name (for the log).
    gpu: Backend
    cpu: Backend | None
    deployment: str
    # The live policy (the forced one, else the deployment's) and the engines' loads now,
    # read again at every re-decision so a policy change lands mid-request.
    knobs: Callable[[], PolicyKnobs]
    loads: Callable[[], Loads]
    metrics: RouterMetrics
    # Seconds an engine has for its first bytes.
    first_byte: float
    # The request as an engine counts it in flight (``Backend.holding``).
    holder: InFlight
    # Counts an engine's failure towards its errors and ejection (once per failure).
    record_failure: Callable[[Backend, UpstreamFailed], None]
    # The request's trace: a span per engine call and for the KV handoff (router.tracing).
    trace: RequestTrace = NO_TRACE

    def failed(self, backend: Backend, message: str) -> UpstreamFailed:
        """A failure of ``backend`` the protocol found in its answer, counted; to raise."""
        failure = UpstreamFailed(backend, message)
        self.record_failure(backend, failure)
        return failure

    def cpu_for_the_rest(self) -> Backend | None:
        """The CPU engine, when it may decode the rest of a sequence whose GPU decode failed:
        it is up and the live policy allows the CPU. None otherwise."""
        cpu = self.cpu
        if cpu is None or not cpu.available(time.monotonic()) or not cpu_allowed(self.knobs()):
            return None
        return cpu

    def slo(self, knobs: PolicyKnobs) -> SloClass:
        """The request's SLO class under ``knobs`` (the live policy's targets)."""
        return knobs.slo_class(self.req.slo_class)

    def base_body(self) -> dict[str, Any]:
        """The client's request without the fields the router sets itself for an engine."""
        body = dict(self.req.body)
        body.pop("stream_options", None)
        body.pop("max_completion_tokens", None)
        return body

    async def prefill_on_gpu(self, body: dict[str, Any]) -> Any:
        """One non-streaming prefill request on the GPU engine, counted as in flight there;
        a failure is counted against the GPU before it is raised."""
        gpu = self.gpu
        with gpu.holding(self.holder):
            try:
                with self.trace.engine_call(gpu.role, gpu.url, "prefill") as span:
                    data = await call_json(
                        gpu.pool,
                        self.req.path,
                        body,
                        within=self.first_byte,
                        headers=span.headers,
                    )
            except UpstreamFailed as exc:
                self.record_failure(gpu, exc)
                raise
        gpu.record_success()
        return data
