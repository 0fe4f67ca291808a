"""PD on sysHAX's patched engines (the ``syshax`` protocol; docs/router.md).

The GPU prefill is a non-streaming request with ``num_decode_tokens: 0`` whose answer names
the KV in ``request_id_inference``; each decode segment of ``num_decode_tokens`` tokens then
runs on the CPU with that id and the text so far, and the decider runs again after each. A
CPU failure (refused, erroring, dying mid-stream) moves the sequence to the GPU, which
recomputes from the prompt plus the text generated so far.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from common.sse import event_data, split_events
from router.backends import Backend
from router.decide import Decision, Route, decide_next_chunk
from router.sse import chunk_parts
from router.transport import UpstreamFailed, request

if TYPE_CHECKING:
    from router.flow import Exchange

log = logging.getLogger("syshax.router")

# With no max_tokens from the client, "decode to the end" still needs a number for the engine.
UNBOUNDED_DECODE = 1 << 20


class SyshaxPd:
    """The ``syshax`` wire protocol; one instance serves every deployment that speaks it."""

    name = "syshax"

    def unspliceable(self, body: dict[str, Any]) -> str | None:
        return None  # the patched engines take the text so far: any request splits

    async def resume(self, ex: Exchange, failed: Backend, why: str) -> bool:
        """A passthrough stream cannot be continued: these engines take no token ids."""
        return False

    async def run(self, ex: Exchange, decision: Decision) -> None:
        out = ex.out
        cpu = ex.deployment.cpu
        request_id, finish = await self._prefill(ex)
        if finish != "scheduled":
            out.finish_reason = finish
            return
        on_cpu = cpu is not None
        kv_id: str | None = request_id
        limit = decision.token_limit
        while True:
            remaining = _remaining(ex)
            if remaining is not None and remaining <= 0:
                finish = "length"
                break
            body = ex.base_body()
            target = cpu if on_cpu and cpu is not None else ex.deployment.gpu
            budget = remaining if remaining is not None else UNBOUNDED_DECODE
            body["num_decode_tokens"] = min(limit, budget) if on_cpu and limit else budget
            body["generated_text"] = "".join(out.pieces)
            if kv_id is not None:
                body["request_id_inference"] = kv_id
            if remaining is not None:
                body["max_tokens"] = remaining
            try:
                finish = await self._segment(ex, target, body)
            except UpstreamFailed as exc:
                if exc.client_error and not out.pieces:
                    raise
                ex.record_failure(exc)
                if target is ex.deployment.gpu:
                    raise
                ex.metrics.fallback("cpu-decode-to-gpu")
                on_cpu, kv_id = False, None
                continue
            if finish != "scheduled":
                break
            if not on_cpu:
                continue
            # Read anew per chunk: a live policy change lands mid-request.
            knobs = ex.state.knobs_for(ex.deployment, ex.req.knobs)
            nxt = decide_next_chunk(knobs, ex.deployment.loads(time.monotonic()))
            ex.metrics.decision("chunk", nxt.route.value, nxt.code)
            if nxt.route is Route.PD:
                limit = nxt.token_limit
            else:
                log.info("%s moves to the GPU: %s", out.request_id, nxt.reason)
                if nxt.fallback:
                    ex.metrics.fallback("cpu-decode-to-gpu")
                on_cpu, kv_id = False, None
        if finish == "scheduled":
            finish = "length"
        out.finish_reason = finish

    async def _prefill(self, ex: Exchange) -> tuple[str, str]:
        """GPU prefill; emits the first token. Returns (request_id_inference, finish_reason)."""
        body = ex.base_body()
        body.update(stream=False, num_decode_tokens=0)
        data = await ex.prefill_on_gpu(body)
        try:
            choice = data["choices"][0]
            text = (choice["message"]["content"] if ex.req.chat else choice["text"]) or ""
            finish = choice.get("finish_reason") or "stop"
            request_id = str(data["id"])
            usage = data.get("usage") or {}
        except (KeyError, IndexError, TypeError):
            raise UpstreamFailed(
                ex.deployment.gpu, "prefill answer has an unexpected shape"
            ) from None
        ex.out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        if text:
            await ex.out.emit(text, int(usage.get("completion_tokens") or 1))
        return request_id, finish

    async def _segment(self, ex: Exchange, backend: Backend, body: dict[str, Any]) -> str:
        """Stream one decode segment into the client's stream; returns its finish reason."""
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        finish: str | None = None
        buffer = bytearray()
        with backend.holding(ex):
            try:
                async with request(
                    backend, ex.req.path, json.dumps(body).encode(), first_byte=ex.first_byte
                ) as resp:
                    await resp.raise_for_status()
                    async for data in resp.iter_body():
                        buffer += data
                        for event in split_events(buffer):
                            payload = event_data(event)
                            if payload is None or payload == b"[DONE]":
                                continue
                            chunk = json.loads(payload)
                            if "error" in chunk:
                                raise UpstreamFailed(backend, f"error event: {chunk['error']}")
                            parts = chunk_parts(chunk, ex.req.chat)
                            if parts.text:
                                await ex.out.emit(parts.text)
                            if parts.finish_reason:
                                finish = parts.finish_reason
            except ValueError:
                raise UpstreamFailed(backend, "malformed stream chunk") from None
        if finish is None:
            raise UpstreamFailed(backend, "stream ended without a finish reason")
        backend.record_success()
        ex.metrics.chunk(backend.role)
        return finish


def _remaining(ex: Exchange) -> int | None:
    if ex.req.max_tokens is None:
        return None
    return ex.req.max_tokens - ex.out.completion_tokens
