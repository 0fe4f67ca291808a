"""One client request on one deployment: passthrough, or PD in the deployment's protocol.

``Exchange`` ties the client's stream (``router.client_stream``) to the engines that produce
it: it counts the request in flight on each engine it uses, records their failures towards
ejection, and hands the sequence to the deployment's PD protocol (``router.pd``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from router.backends import Backend
from router.client_stream import ClientRequest, ClientStream
from router.decide import Decision
from router.metrics import RouterMetrics
from router.state import Deployment, RouterState
from router.transport import UpstreamFailed, call_json, request

log = logging.getLogger("syshax.router")


class Exchange:
    """State of one request on one deployment while it is being served."""

    def __init__(
        self,
        http: web.Request,
        req: ClientRequest,
        state: RouterState,
        deployment: Deployment,
        metrics: RouterMetrics,
        first_byte_timeout: float,
        task: asyncio.Task[Any] | None = None,
    ) -> None:
        self.out = ClientStream(http, req, metrics)
        # The handler's task, cancelled when the engine it waits on leaves the deployment set.
        self.task = task
        self.removed_from: Backend | None = None
        self.req = req
        self.state = state
        self.deployment = deployment
        self.metrics = metrics
        self.first_byte = first_byte_timeout

    def backend_removed(self, backend: Backend) -> bool:
        """The engine this request is on left the deployment set. Unless output already
        went out, cancel the request's task: the server turns that cancellation into a
        ``BackendRemoved`` failure and serves the request elsewhere. A stream that already
        started stays where it is (``Backend.retire``)."""
        if self.out.started or self.removed_from is not None or self.task is None:
            return False
        self.removed_from = backend
        self.task.cancel()
        return True

    def record_failure(self, exc: UpstreamFailed) -> None:
        backend = exc.backend
        if exc.client_error or exc.recorded:
            return
        exc.recorded = True
        self.metrics.backend_error(backend.url, backend.role)
        if backend.record_failure(
            time.monotonic(),
            connect_failed=exc.connect_failed,
            may_eject=self.state.may_eject(backend),
        ):
            self.metrics.ejection(backend.url, backend.role)
        log.warning("upstream failure: %s", exc)

    async def passthrough(self, backend: Backend) -> web.StreamResponse:
        """Forward the client's own bytes; stream the engine's bytes back untouched."""
        out = self.out
        with backend.holding(self):
            try:
                async with request(
                    backend, self.req.path, self.req.raw, first_byte=self.first_byte
                ) as resp:
                    await resp.raise_for_status()
                    if self.req.stream:
                        response = await out.pump(resp)
                    else:
                        body = await resp.read_all()
                        response = out.whole(body, resp.status, resp.content_type)
                backend.record_success()
                return response
            except UpstreamFailed as exc:
                self.record_failure(exc)
                if out.response is None:
                    raise
                if await self.deployment.pd.resume(self, backend, str(exc)):
                    return await out.finish()
                # Bytes already went out; end the stream with an error event, never a hang.
                return await out.abort(str(exc))

    async def run_pd(self, decision: Decision) -> web.StreamResponse:
        """GPU prefill, then decode on the CPU with re-decisions, in the deployment's protocol."""
        await self.deployment.pd.run(self, decision)
        return await self.out.finish()

    def base_body(self) -> dict[str, Any]:
        """The client's request without the fields the router sets itself for an engine."""
        body = dict(self.req.body)
        body.pop("stream_options", None)
        body.pop("max_completion_tokens", None)
        return body

    async def prefill_on_gpu(self, body: dict[str, Any]) -> Any:
        """One non-streaming prefill request on the GPU engine, counted as in flight there."""
        gpu = self.deployment.gpu
        with gpu.holding(self):
            data = await call_json(gpu, self.req.path, body, within=self.first_byte)
        gpu.record_success()
        return data
