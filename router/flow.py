"""One client request from decision to last byte: passthrough, PD, chunked decode, resume.

The client always sees one continuous stream (or one JSON answer) with one id and one usage,
whatever number of upstream requests produced it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

from aiohttp import web

from router.backends import Backend
from router.decide import Decision, Route, decide_next_chunk
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.pd_vllm import VllmPd, resume_stream
from router.rawhttp import RawResponse
from router.rawhttp import request as raw_request
from router.sse import DONE, ChunkBuilder, chunk_parts, full_response
from router.state import Deployment, RouterState
from router.upstream import UpstreamFailed, iter_body, post, post_json
from syshax.common.policy_schema import PolicyKnobs
from syshax.common.sse import event_data, split_events

log = logging.getLogger("syshax.router")

# Which path served the request (gpu-only, pd, cpu-only): for operators and tests.
ROUTE_HEADER = "X-Syshax-Route"

# With no max_tokens from the client, "decode to the end" still needs a number for the engine.
UNBOUNDED_DECODE = 1 << 20


class CoalescedStreamResponse(web.StreamResponse):
    """Headers leave with the first chunk: one write (and one client wake-up) less per stream."""

    _send_headers_immediately = False


# Client socket buffer above which the engine's bytes wait instead of piling up.
HIGH_WATER = 1 << 16


def _direct_writer(
    transport: asyncio.BaseTransport, relayed: list[bytes]
) -> Callable[[bytes], bool]:
    """Writes one payload as an HTTP chunk, from the engine connection's ``data_received``,
    and keeps it in ``relayed`` (for a resume on the other engine if this one dies).
    Declines (the payload then queues for the coroutine) the stream's last event and
    whenever the client is gone or not keeping up."""
    out = cast(asyncio.WriteTransport, transport)

    def direct(payload: bytes) -> bool:
        if payload.endswith(DONE) or out.is_closing() or out.get_write_buffer_size() > HIGH_WATER:
            return False
        out.write(b"%x\r\n" % len(payload) + payload + b"\r\n")
        relayed.append(payload)
        return True

    return direct


async def _drained(transport: asyncio.BaseTransport) -> None:
    """Wait while the client's socket buffer is over the high-water mark."""
    out = cast(asyncio.WriteTransport, transport)
    while out.get_write_buffer_size() > HIGH_WATER:
        if out.is_closing():
            raise ClientGone()
        await asyncio.sleep(0.005)


class ClientGone(Exception):
    """The client disconnected; upstream requests are closed on the way out."""


@dataclass
class ClientRequest:
    path: str
    chat: bool
    body: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    received_at: float
    # Knobs forced for this request by the X-Syshax-Mode header (benchmarks); None: the policy.
    knobs: PolicyKnobs | None = None
    # That header's value, for planning the request again on another replica.
    mode_header: str | None = None


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
        self.http = http
        # The handler's task, cancelled when the engine it waits on leaves the deployment set.
        self.task = task
        self.removed_from: Backend | None = None
        self.req = req
        self.state = state
        self.deployment = deployment
        self.metrics = metrics
        self.first_byte = first_byte_timeout
        self.decision_label = "gpu-only"
        self.response: web.StreamResponse | None = None
        self.pieces: list[str] = []
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.finish_reason = "stop"
        self.last_token_at: float | None = None
        # Token ids of the answer, kept when the client asked for return_token_ids.
        self.token_ids: list[int] = []
        # The SSE payloads a passthrough stream relayed so far.
        self.relayed: list[bytes] = []
        self.prompt_token_ids: list[int] | None = None
        self.created = int(time.time())

    # The id and the chunk builder are only needed when the router writes its own chunks
    # (PD, errors); a passthrough never pays for them.
    @cached_property
    def request_id(self) -> str:
        return ("chatcmpl-" if self.req.chat else "cmpl-") + uuid.uuid4().hex

    @cached_property
    def builder(self) -> ChunkBuilder:
        return ChunkBuilder(
            chat=self.req.chat,
            request_id=self.request_id,
            model=self.req.model,
            created=self.created,
        )

    @property
    def started_output(self) -> bool:
        return self.response is not None or bool(self.pieces)

    def backend_removed(self, backend: Backend) -> bool:
        """The engine this request is on left the deployment set. Unless output already
        went out, cancel the request's task: the server turns that cancellation into a
        ``BackendRemoved`` failure and serves the request elsewhere. A stream that already
        started stays where it is (``Backend.retire``)."""
        if self.started_output or self.removed_from is not None or self.task is None:
            return False
        self.removed_from = backend
        self.task.cancel()
        return True

    # -- output ------------------------------------------------------------------------------

    async def _write(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc

    async def _open_stream(self) -> None:
        response = CoalescedStreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                ROUTE_HEADER: self.decision_label,
            }
        )
        try:
            await response.prepare(self.http)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        self.response = response

    async def _ensure_stream(self) -> None:
        """Open the client's stream on first output; a chat stream starts with the role chunk."""
        if self.response is None:
            await self._open_stream()
            if self.req.chat:
                await self._write(self.builder.role())

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.last_token_at is None:
            self.metrics.observe_ttft(self.decision_label, now - self.req.received_at)
        else:
            self.metrics.observe_itl(self.decision_label, now - self.last_token_at)
        self.last_token_at = now

    async def emit(self, text: str, tokens: int = 1, token_ids: list[int] | None = None) -> None:
        """One token (or a few) of generated text, in order, towards the client.
        ``token_ids`` (PD on vLLM) are passed on when the client asked for them."""
        self._tick()
        self.completion_tokens += tokens
        want_ids = token_ids is not None and self.req.body.get("return_token_ids") is True
        if want_ids:
            assert token_ids is not None
            self.token_ids.extend(token_ids)
        if not text and not want_ids:
            return  # e.g. a token that ends inside a multi-byte character
        self.pieces.append(text)
        if not self.req.stream:
            return
        await self._ensure_stream()
        if want_ids:
            await self._write(self.builder.text_with_ids(text, token_ids or []))
        else:
            await self._write(self.builder.text(text))

    async def finish(self) -> web.StreamResponse:
        """Close the spliced stream, or build the non-streaming answer."""
        if not self.req.stream:
            body = full_response(
                chat=self.req.chat,
                request_id=self.request_id,
                model=self.req.model,
                created=self.created,
                text="".join(self.pieces),
                finish_reason=self.finish_reason,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
            )
            if self.req.body.get("return_token_ids") is True and self.prompt_token_ids:
                body["choices"][0]["token_ids"] = self.token_ids
                where = body if self.req.chat else body["choices"][0]
                where["prompt_token_ids"] = self.prompt_token_ids
            return web.Response(
                body=json.dumps(body).encode(),
                content_type="application/json",
                headers={ROUTE_HEADER: self.decision_label},
            )
        await self._ensure_stream()
        tail = self.builder.finish(self.finish_reason)
        if self.req.include_usage:
            tail += self.builder.usage(self.prompt_tokens, self.completion_tokens)
        await self._write(tail + DONE)
        assert self.response is not None
        await self.response.write_eof()
        return self.response

    async def abort_stream(
        self, message: str, *, client_gone_ok: bool = False
    ) -> web.StreamResponse:
        """End a stream that already started with an error event: never a hang, never a trace.
        Without an open stream the error is a 502 answer instead. A client that left meanwhile
        raises ClientGone unless ``client_gone_ok`` (then the stream is returned as it is)."""
        if not self.req.stream or self.response is None:
            raise RouterError(502, message, type_="server_error", code="backend_error")
        try:
            await self.response.write(self.builder.error(message, "backend_error") + DONE)
            await self.response.write_eof()
        except (ConnectionError, RuntimeError) as exc:
            if not client_gone_ok:
                raise ClientGone() from exc
        return self.response

    # -- upstream helpers --------------------------------------------------------------------

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
        with backend.holding(self):
            resp: RawResponse | None = None
            try:
                resp = await raw_request(
                    backend.pool, backend, self.req.path, self.req.raw, first_byte=self.first_byte
                )
                if resp.status >= 300:
                    body = await resp.read_all()
                    raise UpstreamFailed(
                        backend, f"HTTP {resp.status}", status=resp.status, body=body
                    )
                if not self.req.stream:
                    body = await resp.read_all()
                    backend.record_success()
                    self._tick()
                    return web.Response(
                        body=body,
                        status=resp.status,
                        content_type=resp.content_type,
                        headers={ROUTE_HEADER: self.decision_label},
                    )
                response = await self._pump(resp)
                backend.record_success()
                return response
            except UpstreamFailed as exc:
                self.record_failure(exc)
                if self.response is not None:
                    if self.deployment.spec.pd_protocol == "vllm" and await resume_stream(
                        self, backend, str(exc)
                    ):
                        return await self.finish()
                    # Bytes already went out; end the stream with an error event, never a hang.
                    return await self.abort_stream(str(exc))
                raise
            finally:
                if resp is not None:
                    resp.finish()

    async def _pump(self, resp: RawResponse) -> web.StreamResponse:
        """Stream the engine's SSE payloads to the client. The first token goes through here
        (headers leave with it, TTFT is recorded); after it, payloads are written to the
        client's socket from the engine connection's callback (``direct``)."""
        transport = self.http.transport
        # Own chunk framing needs a chunked (HTTP/1.1) response; HTTP/1.0 stays on aiohttp.
        direct_ok = transport is not None and self.http.version >= (1, 1)
        held = b""
        while True:
            data, finished = await resp.next()
            # TTFT is the first token, not the chat role-only chunk that precedes it.
            if (
                data
                and self.last_token_at is None
                and not (b'"role"' in data and data.count(b"data:") == 1)
            ):
                self._tick()
            if finished:
                break
            if not data:
                continue
            if self.response is None:
                await self._open_stream()
            if held:
                await self._write(held)
                self.relayed.append(held)
                held = b""
            if data.endswith(DONE):
                held = data  # the last event leaves with the terminating chunk: one write
                continue
            await self._write(data)
            self.relayed.append(data)
            if transport is not None:
                await _drained(transport)
                if direct_ok and self.last_token_at is not None and resp.conn.direct is None:
                    resp.set_direct(_direct_writer(transport, self.relayed))
        if self.response is None:
            await self._open_stream()
        assert self.response is not None
        try:
            await self.response.write_eof(held + data)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        return self.response

    def _base_body(self) -> dict[str, Any]:
        body = dict(self.req.body)
        body.pop("stream_options", None)
        body.pop("max_completion_tokens", None)
        return body

    async def _segment(self, backend: Backend, body: dict[str, Any]) -> str:
        """Stream one decode segment into the client's stream; returns its finish reason."""
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        finish: str | None = None
        buffer = bytearray()
        with backend.holding(self):
            try:
                async with post(
                    backend, self.req.path, json.dumps(body).encode(), first_byte=self.first_byte
                ) as resp:
                    async for data in iter_body(resp, backend, self.first_byte):
                        buffer += data
                        for event in split_events(buffer):
                            payload = event_data(event)
                            if payload is None or payload == b"[DONE]":
                                continue
                            chunk = json.loads(payload)
                            if "error" in chunk:
                                raise UpstreamFailed(backend, f"error event: {chunk['error']}")
                            parts = chunk_parts(chunk, self.req.chat)
                            if parts.text:
                                await self.emit(parts.text)
                            if parts.finish_reason:
                                finish = parts.finish_reason
            except ValueError:
                raise UpstreamFailed(backend, "malformed stream chunk") from None
        if finish is None:
            raise UpstreamFailed(backend, "stream ended without a finish reason")
        backend.record_success()
        self.metrics.chunk(backend.role)
        return finish

    def _remaining(self) -> int | None:
        if self.req.max_tokens is None:
            return None
        return self.req.max_tokens - self.completion_tokens

    # -- PD ----------------------------------------------------------------------------------

    async def _prefill_on_gpu(self, body: dict[str, Any]) -> Any:
        """One non-streaming prefill request on the GPU engine, counted as in flight there."""
        gpu = self.deployment.gpu
        with gpu.holding(self):
            data = await post_json(gpu, self.req.path, body, first_byte=self.first_byte)
        gpu.record_success()
        return data

    async def _prefill_syshax(self) -> tuple[str, str]:
        """GPU prefill; emits the first token. Returns (request_id_inference, finish_reason)."""
        body = self._base_body()
        body.update(stream=False, num_decode_tokens=0)
        data = await self._prefill_on_gpu(body)
        try:
            choice = data["choices"][0]
            text = (choice["message"]["content"] if self.req.chat else choice["text"]) or ""
            finish = choice.get("finish_reason") or "stop"
            request_id = str(data["id"])
            usage = data.get("usage") or {}
        except (KeyError, IndexError, TypeError):
            raise UpstreamFailed(
                self.deployment.gpu, "prefill answer has an unexpected shape"
            ) from None
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        if text:
            await self.emit(text, int(usage.get("completion_tokens") or 1))
        return request_id, finish

    async def run_pd(self, decision: Decision) -> None:
        """GPU prefill, then decode on the CPU with a re-decision every ``token_limit``
        tokens, in the deployment's wire protocol."""
        if self.deployment.spec.pd_protocol == "vllm":
            await VllmPd(self).run(decision)
        else:
            await self._run_pd_syshax(decision)

    async def _run_pd_syshax(self, decision: Decision) -> None:
        """sysHAX's patched engines: chunks of ``num_decode_tokens`` with a re-decision after
        each. A CPU failure (refused, erroring, dying mid-stream) moves the sequence to the
        GPU, which recomputes from the prompt plus the text generated so far."""
        cpu = self.deployment.cpu
        request_id, finish = await self._prefill_syshax()
        if finish != "scheduled":
            self.finish_reason = finish
            return
        on_cpu = cpu is not None
        kv_id: str | None = request_id
        limit = decision.token_limit
        while True:
            remaining = self._remaining()
            if remaining is not None and remaining <= 0:
                finish = "length"
                break
            body = self._base_body()
            target = cpu if on_cpu and cpu is not None else self.deployment.gpu
            budget = remaining if remaining is not None else UNBOUNDED_DECODE
            body["num_decode_tokens"] = min(limit, budget) if on_cpu and limit else budget
            body["generated_text"] = "".join(self.pieces)
            if kv_id is not None:
                body["request_id_inference"] = kv_id
            if remaining is not None:
                body["max_tokens"] = remaining
            try:
                finish = await self._segment(target, body)
            except UpstreamFailed as exc:
                if exc.client_error and not self.pieces:
                    raise
                self.record_failure(exc)
                if target is self.deployment.gpu:
                    raise
                self.metrics.fallback("cpu-decode-to-gpu")
                on_cpu, kv_id = False, None
                continue
            if finish != "scheduled":
                break
            if not on_cpu:
                continue
            # Read anew per chunk: a live policy change lands mid-request.
            knobs = self.state.knobs_for(self.deployment, self.req.knobs)
            loads = self.deployment.loads(time.monotonic())
            nxt = decide_next_chunk(knobs, loads)
            self.metrics.decision("chunk", nxt.route.value, nxt.code)
            if nxt.route is Route.PD:
                limit = nxt.token_limit
            else:
                log.info("%s moves to the GPU: %s", self.request_id, nxt.reason)
                if nxt.fallback:
                    self.metrics.fallback("cpu-decode-to-gpu")
                on_cpu, kv_id = False, None
        if finish == "scheduled":
            finish = "length"
        self.finish_reason = finish
