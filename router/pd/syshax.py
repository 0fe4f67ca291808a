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
from typing import Any

from common.sse import event_data, split_events
from router.client.sse import chunk_parts
from router.decide import Decision, Route, Stage, decide_next_chunk
from router.engines.backends import Backend
from router.engines.transport import UpstreamFailed, request
from router.pd.sequence import PdSequence

log = logging.getLogger("syshax.router")

# With no max_tokens from the client, "decode to the end" still needs a number for the engine.
UNBOUNDED_DECODE = 1 << 20


class SyshaxPd:
    """The ``syshax`` wire protocol; one instance serves every deployment that speaks it."""

    name = "syshax"

    def unspliceable(self, body: dict[str, Any]) -> str | None:
        return None  # the patched engines take the text so far: any request splits

    async def resume(self, seq: PdSequence, failed: Backend, why: str) -> bool:
        """A passthrough stream cannot be continued: these engines take no token ids."""
        return False

    async def run(self, seq: PdSequence, decision: Decision) -> None:
        out = seq.out
        cpu = seq.cpu
        request_id, finish = await self._prefill(seq)
        if finish != "scheduled":
            out.finish_reason = finish
            return
        on_cpu = cpu is not None
        kv_id: str | None = request_id
        limit = decision.token_limit
        gpu_failed = False
        while True:
            remaining = _remaining(seq)
            if remaining is not None and remaining <= 0:
                finish = "length"
                break
            body = seq.base_body()
            target = cpu if on_cpu and cpu is not None else seq.gpu
            budget = remaining if remaining is not None else UNBOUNDED_DECODE
            body["num_decode_tokens"] = min(limit, budget) if on_cpu and limit else budget
            body["generated_text"] = "".join(out.pieces)
            if kv_id is not None:
                body["request_id_inference"] = kv_id
            if remaining is not None:
                body["max_tokens"] = remaining
            try:
                finish = await self._segment(seq, target, body)
            except UpstreamFailed as exc:
                if exc.client_error and not out.pieces:
                    raise
                seq.record_failure(target, exc)
                if target is seq.gpu:
                    # Once: the CPU goes on from the prompt and the text so far.
                    if gpu_failed or seq.cpu_for_the_rest() is None:
                        raise
                    gpu_failed = True
                    seq.metrics.fallback("gpu-decode-to-cpu")
                    on_cpu, kv_id = True, None
                    continue
                seq.metrics.fallback("cpu-decode-to-gpu")
                on_cpu, kv_id = False, None
                continue
            if finish != "scheduled":
                break
            if not on_cpu:
                continue
            # Read anew per chunk: a live policy change lands mid-request.
            knobs = seq.knobs()
            nxt = decide_next_chunk(knobs, seq.loads(), seq.slo(knobs))
            seq.metrics.decision(Stage.CHUNK, nxt.route, nxt.code)
            if nxt.route is Route.PD:
                limit = nxt.token_limit
            else:
                log.info("%s moves to the GPU: %s", out.request_id, nxt.reason)
                if nxt.fallback:
                    seq.metrics.fallback("cpu-decode-to-gpu")
                on_cpu, kv_id = False, None
        if finish == "scheduled":
            finish = "length"
        out.finish_reason = finish

    async def _prefill(self, seq: PdSequence) -> tuple[str, str]:
        """GPU prefill; emits the first token. Returns (request_id_inference, finish_reason)."""
        body = seq.base_body()
        body.update(stream=False, num_decode_tokens=0)
        data = await seq.prefill_on_gpu(body)
        try:
            choice = data["choices"][0]
            text = (choice["message"]["content"] if seq.req.chat else choice["text"]) or ""
            finish = choice.get("finish_reason") or "stop"
            request_id = str(data["id"])
            usage = data.get("usage") or {}
        except (KeyError, IndexError, TypeError):
            raise seq.failed(seq.gpu, "prefill answer has an unexpected shape") from None
        seq.out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        if text:
            await seq.out.emit(text, int(usage.get("completion_tokens") or 1))
        return request_id, finish

    async def _segment(self, seq: PdSequence, backend: Backend, body: dict[str, Any]) -> str:
        """Stream one decode segment into the client's stream; returns its finish reason."""
        body["stream"] = True
        # Usage on every chunk where the engine gives it: a chunk may carry several tokens.
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        finish: str | None = None
        buffer = bytearray()
        # This segment's completion tokens: counted so far, and as the engine last reported.
        counted = 0
        reported: int | None = None
        with (
            backend.holding(seq.holder),
            seq.trace.engine_call(backend.role, backend.url, "decode") as span,
        ):
            try:
                async with request(
                    backend.pool,
                    seq.req.path,
                    json.dumps(body).encode(),
                    first_byte=seq.first_byte,
                    headers=span.headers,
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
                            parts = chunk_parts(chunk, seq.req.chat)
                            tokens = _reported(parts.usage)
                            if tokens is not None:
                                reported = tokens
                            if parts.text:
                                # sysHAX's engines send no token ids: a text chunk is one
                                # token unless its usage (continuous) says how many so far.
                                n = 1 if tokens is None else max(0, tokens - counted)
                                counted += n
                                await seq.out.emit(parts.text, n)
                            if parts.finish_reason:
                                finish = parts.finish_reason
            except ValueError:
                raise UpstreamFailed(backend, "malformed stream chunk") from None
            finally:
                # Finished or cut short: the segment's tokens are the engine's own count.
                if reported is not None and reported != counted:
                    seq.out.completion_tokens += reported - counted
                span.set("syshax.engine.tokens", reported if reported is not None else counted)
        if finish is None:
            raise UpstreamFailed(backend, "stream ended without a finish reason")
        backend.record_success()
        seq.metrics.chunk(backend.role)
        return finish


def _reported(usage: dict[str, Any] | None) -> int | None:
    tokens = usage.get("completion_tokens") if usage is not None else None
    return tokens if isinstance(tokens, int) else None


def _remaining(seq: PdSequence) -> int | None:
    if seq.req.max_tokens is None:
        return None
    return seq.req.max_tokens - seq.out.completion_tokens
