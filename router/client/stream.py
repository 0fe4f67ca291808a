"""The client's side of one request: its answer as one stream (or one JSON body).

Whatever number of engine requests produce an answer, the client sees one stream with one
id and one usage. ``ClientStream`` owns that stream: the response headers, the chunks the
router writes itself (PD), the bytes relayed untouched (passthrough), the answer's text,
token counts and finish reason, and the TTFT/ITL the client saw. It knows nothing of
engines, policies or deployments.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, cast

from aiohttp import web

from common.policy_schema import PolicyKnobs
from common.tenants import TenantRecord
from router.client.errors import RouterError
from router.client.sse import DONE, ChunkBuilder, full_response
from router.metrics import RouterMetrics

# Which path served the request (gpu-only, pd, cpu-only): for operators and tests.
ROUTE_HEADER = "X-Syshax-Route"
# Why the decider chose that route: its short ASCII code (docs/router.md), e.g. ``short-prompt``.
REASON_HEADER = "X-Syshax-Reason"

# Client socket buffer above which the engine's bytes wait instead of piling up.
HIGH_WATER = 1 << 16


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
    # Its SLO class (router/client/classes.py) and who sent it (None: nobody authenticated).
    slo_class: str = "standard"
    tenant: TenantRecord | None = None
    # The decision pipeline's step that gave its latest route (router.plan), for its trace.
    decided_by: str = ""


class Relayed(Protocol):
    """An engine's streamed body as the pump reads it
    (``router.engines.transport.EngineResponse``)."""

    async def next(self) -> tuple[bytes, bool]: ...

    def set_direct(self, direct: Callable[[bytes], bool] | None) -> None: ...

    @property
    def direct_set(self) -> bool: ...


class CoalescedStreamResponse(web.StreamResponse):
    """Headers leave with the first chunk: one write (and one client wake-up) less per stream."""

    _send_headers_immediately = False


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


class ClientStream:
    """One client's answer while it is being produced."""

    def __init__(self, http: web.Request, req: ClientRequest, metrics: RouterMetrics) -> None:
        self.http = http
        self.req = req
        self.metrics = metrics
        self.decision_label = "gpu-only"
        self.decision_reason = ""  # the decider's code, sent as REASON_HEADER when set
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
        # A relayed stream's last bytes (its usage chunk, if the client asked for one).
        self.tail = b""
        self.created = int(time.time())

    # The id and the chunk builder are only needed when the router writes its own chunks
    # (PD, errors); a passthrough never pays for them.
    @cached_property
    def request_id(self) -> str:
        return ("chatcmpl-" if self.req.chat else "cmpl-") + uuid.uuid4().hex

    def keep_id(self, request_id: str, created: int) -> None:
        """Answer under an id an engine already gave the client (a resumed stream)."""
        if "request_id" not in self.__dict__:
            self.__dict__["request_id"] = request_id
            self.created = created or self.created

    @cached_property
    def builder(self) -> ChunkBuilder:
        return ChunkBuilder(
            chat=self.req.chat,
            request_id=self.request_id,
            model=self.req.model,
            created=self.created,
        )

    @property
    def started(self) -> bool:
        """Output went out (or was produced for a non-streaming answer)."""
        return self.response is not None or bool(self.pieces)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc

    def route_headers(self) -> dict[str, str]:
        """The route that served the answer and, when known, the decider's reason code."""
        headers = {ROUTE_HEADER: self.decision_label}
        if self.decision_reason:
            headers[REASON_HEADER] = self.decision_reason
        return headers

    async def open(self) -> None:
        response = CoalescedStreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **self.route_headers(),
            }
        )
        try:
            await response.prepare(self.http)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        self.response = response

    async def _ensure_open(self) -> None:
        """Open the client's stream on first output; a chat stream starts with the role chunk."""
        if self.response is None:
            await self.open()
            if self.req.chat:
                await self.write(self.builder.role())

    def tick(self) -> None:
        """A token reached the client: TTFT for the first, ITL for every later one."""
        now = time.perf_counter()
        if self.last_token_at is None:
            self.metrics.observe_ttft(
                self.decision_label, now - self.req.received_at, self.req.model
            )
        else:
            self.metrics.observe_itl(self.decision_label, now - self.last_token_at)
        self.last_token_at = now

    async def emit(self, text: str, tokens: int = 1, token_ids: list[int] | None = None) -> None:
        """One token (or a few) of generated text, in order, towards the client.
        ``token_ids`` (PD on vLLM) are passed on when the client asked for them."""
        self.tick()
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
        await self._ensure_open()
        if want_ids:
            await self.write(self.builder.text_with_ids(text, token_ids or []))
        else:
            await self.write(self.builder.text(text))

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
                headers=self.route_headers(),
            )
        await self._ensure_open()
        tail = self.builder.finish(self.finish_reason)
        if self.req.include_usage:
            tail += self.builder.usage(self.prompt_tokens, self.completion_tokens)
        await self.write(tail + DONE)
        assert self.response is not None
        await self.response.write_eof()
        return self.response

    async def abort(self, message: str, *, client_gone_ok: bool = False) -> web.StreamResponse:
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

    def whole(self, body: bytes, status: int, content_type: str) -> web.Response:
        """An engine's non-streaming answer, relayed as it is."""
        self.tick()
        return web.Response(
            body=body,
            status=status,
            content_type=content_type,
            headers=self.route_headers(),
        )

    async def pump(self, resp: Relayed) -> web.StreamResponse:
        """Relay an engine's SSE payloads untouched. The first token goes through here
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
                self.tick()
            if finished:
                break
            if not data:
                continue
            if self.response is None:
                await self.open()
            if held:
                await self.write(held)
                self.relayed.append(held)
                held = b""
            if data.endswith(DONE):
                held = data  # the last event leaves with the terminating chunk: one write
                continue
            await self.write(data)
            self.relayed.append(data)
            if transport is not None:
                await _drained(transport)
                if direct_ok and self.last_token_at is not None and not resp.direct_set:
                    resp.set_direct(_direct_writer(transport, self.relayed))
        if self.response is None:
            await self.open()
        assert self.response is not None
        self.tail = held + data
        try:
            await self.response.write_eof(self.tail)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        return self.response
