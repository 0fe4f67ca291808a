"""PD on upstream vLLM V1 engines with the SyshaxShmConnector (docs/kv-connector.md).

1. Prefill: the client's request on the GPU engine with ``max_tokens: 1``,
   ``return_token_ids`` and ``kv_transfer_params: {"do_remote_decode": true}``. Its answer
   has the first token (text and id), the prompt's token ids (the chat template already
   rendered by the engine) and the transfer's ``kv_transfer_params``.
2. Decode: ``/v1/completions`` on the CPU engine with the prompt's token ids plus the
   first token as the prompt, the transfer's params, and the client's sampling fields,
   streamed with ``return_token_ids`` and ``include_usage``. Every ``token_limit`` tokens the
   decider runs again; staying on the CPU costs nothing (the same stream goes on).
3. Moving to the GPU (the decider, or the CPU engine failing mid-stream): the CPU stream is
   closed (vLLM aborts the request) and ``/v1/completions`` continues on the GPU from the
   exact token ids generated so far, so the client sees one answer with nothing repeated or
   missing.

Usage comes from the engines' token ids and usage chunks, never from counting text chunks.
The decode engine's ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``) proves it used the transferred KV: fewer cached tokens
than transferred is a silent recompute, counted as ``kv_miss``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from common.sse import event_data, split_events
from router.decide import (
    Decision,
    Mode,
    Route,
    Stage,
    cpu_allowed,
    decide_next_chunk,
    token_limit,
)
from router.engines.backends import Backend
from router.engines.transport import UpstreamFailed, call_json, request
from router.pd.sequence import PdSequence
from router.tracing import KV_HANDOFF, Step

log = logging.getLogger("syshax.router")

COMPLETIONS = "/v1/completions"
# Request fields that only shape the client's answer or its prompt: not sent to a decode
# engine, which gets the prompt as token ids on the completions endpoint. (``priority`` is
# sent: the router sets it from the request's SLO class, only to engines that schedule by it.)
PROMPT_FIELDS = frozenset(
    {
        "messages",
        "prompt",
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "echo",
        "suffix",
        "best_of",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "add_special_tokens",
        "kv_transfer_params",
        "return_token_ids",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "request_id",
        "mm_processor_kwargs",
    }
)
# Fields that make a PD splice impossible or wrong: such requests stay on one engine.
UNSPLICEABLE = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "tools", "functions")
# Consecutive silent recomputes after which the CPU path counts as failed (one backend
# failure towards ejection per further miss).
KV_MISS_FAILURE_AFTER = 3


def spliceable(body: dict[str, Any]) -> str | None:
    """Why a request cannot be split across engines, or None when it can."""
    for key in UNSPLICEABLE:
        value = body.get(key)
        if value not in (None, False, 0, []):
            return f"{key} cannot be spliced across engines"
    if body.get("max_tokens") == 1 or body.get("max_completion_tokens") == 1:
        return "max_tokens 1: the prefill is the whole answer"
    return None


@dataclass
class Transfer:
    params: dict[str, Any]
    num_tokens: int
    transfer_id: str
    lease_expires_at: float


class VllmProtocol:
    """The ``vllm`` wire protocol; one instance serves every deployment that speaks it."""

    name = "vllm"

    def unspliceable(self, body: dict[str, Any]) -> str | None:
        return spliceable(body)

    async def run(self, seq: PdSequence, decision: Decision) -> None:
        await VllmPd(seq).run(decision)

    async def resume(self, seq: PdSequence, failed: Backend, why: str) -> bool:
        return await resume_stream(seq, failed, why)


class VllmPd:
    """One PD sequence on vLLM engines; writes into the sequence's client stream."""

    def __init__(self, seq: PdSequence) -> None:
        self.seq = seq
        self.prompt_ids: list[int] = []
        self.generated: list[int] = []
        self.transfer: Transfer | None = None
        # The handoff's span, from the prefill's answer to the decode engine's verdict.
        self.handoff: Step | None = None
        # The prefill engine could not publish the KV (its arena full): decode where it is.
        self.kv_fallback = False
        self.min_tokens = seq.req.body.get("min_tokens")

    # -- steps -------------------------------------------------------------------------

    async def run(self, decision: Decision) -> None:
        try:
            await self._run(decision)
        finally:
            if self.handoff is not None:  # published, never loaded: the sequence ended first
                self.handoff.set("syshax.kv.outcome", "unused")
                self.handoff.end()

    async def _run(self, decision: Decision) -> None:
        seq = self.seq
        finish = await self.prefill()
        if finish != "length" or self.remaining() == 0:
            seq.out.finish_reason = finish
            return
        cpu = seq.cpu
        target = cpu if cpu is not None and not self.kv_fallback else seq.gpu
        # A re-decision point costs nothing here (the stream goes on), so even "to the end"
        # decisions (forced-pd) get one every token_limit tokens: a live policy change lands.
        limit = decision.token_limit or token_limit(
            seq.knobs(), cpu.throughput_tps if cpu is not None else 0.0
        )
        gpu_failed = False
        while True:
            remaining = self.remaining()
            if remaining == 0:
                finish = "length"
                break
            try:
                finish, moved = await self.decode(target, limit)
            except UpstreamFailed as exc:
                if exc.client_error and not seq.out.pieces:
                    raise
                seq.record_failure(target, exc)
                if target is seq.gpu:
                    # Once: the CPU recomputes the prompt and the tokens so far, then decodes on.
                    cpu = None if gpu_failed else seq.cpu_for_the_rest()
                    if cpu is None:
                        raise
                    gpu_failed = True
                    log.warning(
                        "%s: GPU decode failed after %d tokens (%s); resuming on the CPU",
                        seq.out.request_id,
                        len(self.generated),
                        exc,
                    )
                    seq.metrics.fallback("gpu-decode-to-cpu")
                    target = cpu
                    continue
                log.warning(
                    "%s: CPU decode failed after %d tokens (%s); resuming on the GPU",
                    seq.out.request_id,
                    len(self.generated),
                    exc,
                )
                seq.metrics.fallback("cpu-decode-to-gpu")
                target = seq.gpu
                continue
            if not moved:
                break
            target = seq.gpu
        seq.out.finish_reason = finish

    def remaining(self) -> int | None:
        limit = self.seq.req.max_tokens
        return None if limit is None else max(0, limit - len(self.generated))

    async def prefill(self) -> str:
        """GPU prefill of the client's own request; emits the first token."""
        seq = self.seq
        gpu = seq.gpu
        body = seq.base_body()
        body.update(
            stream=False,
            max_tokens=1,
            return_token_ids=True,
            kv_transfer_params={"do_remote_decode": True},
        )
        data = await seq.prefill_on_gpu(body)
        try:
            choice = data["choices"][0]
            text = (choice["message"]["content"] if seq.req.chat else choice["text"]) or ""
            token_ids = [int(t) for t in choice["token_ids"]]
            prompt_ids = choice.get("prompt_token_ids") or data.get("prompt_token_ids")
            self.prompt_ids = [int(t) for t in prompt_ids]
            finish = str(choice.get("finish_reason") or "stop")
            usage = data.get("usage") or {}
        except (KeyError, IndexError, TypeError, ValueError):
            raise seq.failed(
                gpu,
                "prefill answer lacks token ids (an engine without return_token_ids: "
                "vLLM >= 0.10.2 is required for the vllm PD protocol)",
            ) from None
        seq.out.prompt_tokens = int(usage.get("prompt_tokens") or len(self.prompt_ids))
        params = data.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("transfer_id"):
            clean = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
            self.transfer = Transfer(
                params=clean,
                num_tokens=int(params.get("num_tokens") or len(self.prompt_ids)),
                transfer_id=str(params["transfer_id"]),
                lease_expires_at=float(params.get("lease_expires_at") or 0.0),
            )
            self.handoff = seq.trace.step(
                KV_HANDOFF,
                {
                    "syshax.kv.transfer_id": self.transfer.transfer_id,
                    "syshax.kv.tokens": self.transfer.num_tokens,
                },
            )
        elif isinstance(params, dict) and params.get("syshax_kv_fallback"):
            # Counted, not failed: the GPU engine holds the prompt's KV and decodes it.
            self.kv_fallback = True
            self.kv_outcome("fallback")
            log.warning(
                "deployment %s: GPU engine %s kept request %s (%s); it decodes there",
                seq.deployment,
                gpu.url,
                seq.out.request_id,
                str(params["syshax_kv_fallback"])[:300],
            )
        elif finish == "length":
            # The GPU engine has no connector: the decode recomputes the prompt.
            self.kv_outcome("none")
            log.warning(
                "deployment %s: GPU engine %s published no kv_transfer_params (is "
                "SyshaxShmConnector in its --kv-transfer-config?); the CPU recomputes the prompt",
                seq.deployment,
                gpu.url,
            )
        self.generated.extend(token_ids)
        seq.out.prompt_token_ids = self.prompt_ids
        if text or token_ids:
            await seq.out.emit(text, len(token_ids), token_ids)
        return finish

    def kv_outcome(self, outcome: str, cached: int | None = None) -> None:
        """The handoff's outcome (router.metrics' ``kv_transfers_total`` label), counted and
        recorded on its span (one of no duration where nothing was handed off)."""
        self.seq.metrics.kv_transfer(outcome)
        step, self.handoff = self.handoff or self.seq.trace.step(KV_HANDOFF), None
        step.set("syshax.kv.outcome", outcome)
        if cached is not None:
            step.set("syshax.kv.cached_tokens", cached)
        step.end()

    def _decode_body(self, limit_tokens: int | None, transfer: Transfer | None) -> bytes:
        req = self.seq.req
        body = {k: v for k, v in req.body.items() if k not in PROMPT_FIELDS}
        body.update(
            model=req.model,
            prompt=self.prompt_ids + self.generated,
            stream=True,
            # Usage on every chunk too (vLLM's continuous_usage_stats): a stream cut short
            # is still counted in the engine's tokens, not in what the router saw of them.
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            return_token_ids=True,
        )
        if limit_tokens is not None:
            body["max_tokens"] = limit_tokens
        if isinstance(self.min_tokens, int) and self.min_tokens > 0:
            body["min_tokens"] = max(0, self.min_tokens - len(self.generated))
        if transfer is not None:
            body["kv_transfer_params"] = transfer.params
        return json.dumps(body).encode()

    async def decode(self, target: Backend, limit: int, call: str = "decode") -> tuple[str, bool]:
        """Stream from ``target`` until the sequence ends or the decider moves it to the GPU.

        Returns (finish reason, moved). ``limit`` is the CPU's chunk (0: to the end); ``call``
        names the engine call in the request's trace (``decode``, or ``resume``)."""
        seq = self.seq
        on_cpu = target is seq.cpu
        # The prefill's KV is for the first decode, and only a CPU engine loads it.
        transfer = self.transfer if on_cpu else None
        self.transfer = None
        body = self._decode_body(self.remaining(), transfer)
        since_decision = 0
        finish: str | None = None
        usage: dict[str, Any] | None = None
        received = 0
        buffer = bytearray()
        with (
            target.holding(seq.holder),
            seq.trace.engine_call(target.role, target.url, call) as span,
        ):
            try:
                async with request(
                    target.pool, COMPLETIONS, body, first_byte=seq.first_byte, headers=span.headers
                ) as resp:
                    await resp.raise_for_status()
                    async for data in resp.iter_body():
                        buffer += data
                        for chunk in _chunks(buffer, target):
                            if "error" in chunk:
                                raise UpstreamFailed(target, f"error event: {chunk['error']}")
                            if isinstance(chunk.get("usage"), dict):
                                usage = chunk["usage"]
                            choices = chunk.get("choices") or []
                            if not choices:
                                continue
                            choice = choices[0]
                            ids = [int(t) for t in choice.get("token_ids") or ()]
                            text = choice.get("text") or ""
                            if ids or text:
                                self.generated.extend(ids)
                                received += len(ids)
                                since_decision += len(ids)
                                await seq.out.emit(text, len(ids), ids)
                            if choice.get("finish_reason"):
                                finish = str(choice["finish_reason"])
                        if finish is not None or not on_cpu or not limit or since_decision < limit:
                            continue
                        # A chunk boundary: decide again (a live policy change lands here).
                        seq.metrics.chunk(target.role)
                        since_decision = 0
                        knobs = seq.knobs()
                        with target.uncounted():  # the decider must not count this one
                            nxt = decide_next_chunk(knobs, seq.loads(), seq.slo(knobs))
                        seq.metrics.decision(Stage.CHUNK, nxt.route, nxt.code)
                        if nxt.route is Route.PD:
                            limit = nxt.token_limit
                            continue
                        log.info(
                            "%s moves to the GPU after %d tokens: %s",
                            seq.out.request_id,
                            len(self.generated),
                            nxt.reason,
                        )
                        if nxt.fallback:
                            seq.metrics.fallback("cpu-decode-to-gpu")
                        self._check_kv(target, transfer, usage)
                        span.set("syshax.moved_to", "gpu")
                        return "length", True
            except ValueError:
                raise UpstreamFailed(target, "malformed stream chunk") from None
            finally:
                span.set("syshax.engine.tokens", received)
                if transfer is not None and usage is None:
                    self.kv_outcome("unverified")
                # Moved, finished or failed: this request's tokens are the engine's own count.
                _settle_usage(seq, target, usage, received, finish is not None)
        if finish is None:
            raise UpstreamFailed(target, "stream ended without a finish reason")
        target.record_success()
        seq.metrics.chunk(target.role)
        self._check_kv(target, transfer, usage)
        return finish, False

    def _check_kv(
        self, target: Backend, transfer: Transfer | None, usage: dict[str, Any] | None
    ) -> None:
        """Compare the decode engine's cached prompt tokens with what was transferred."""
        if transfer is None or usage is None:
            return
        seq = self.seq
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None:
            self.kv_outcome("unverified")
            return
        if int(cached) >= transfer.num_tokens:
            target.kv_misses = 0
            self.kv_outcome("hit", int(cached))
            return
        self.kv_outcome("kv_miss", int(cached))
        target.kv_misses += 1
        cause = (
            "its lease had expired"
            if transfer.lease_expires_at and time.time() > transfer.lease_expires_at
            else "see the engine's log for the connector's reason"
        )
        log.warning(
            "deployment %s: %s engine %s recomputed the prompt instead of loading transfer %s "
            "(%d of %d tokens cached; %s)",
            seq.deployment,
            target.role,
            target.url,
            transfer.transfer_id,
            int(cached),
            transfer.num_tokens,
            cause,
        )
        if target.kv_misses >= KV_MISS_FAILURE_AFTER:
            misses = UpstreamFailed(target, f"{target.kv_misses} consecutive KV handoff misses")
            seq.record_failure(target, misses)


def _settle_usage(
    seq: PdSequence, target: Backend, usage: dict[str, Any] | None, received: int, ended: bool
) -> None:
    """Count one decode request's completion tokens as its engine reported them (its last
    usage: the final chunk's, or a cut stream's last continuous one), not as the token ids
    the router received; without any usage the token ids stand."""
    reported = usage.get("completion_tokens") if usage is not None else None
    if not isinstance(reported, int) or reported == received:
        return
    if ended:
        log.warning(
            "%s: %s engine reported %d completion tokens, sent %d token ids",
            seq.out.request_id,
            target.role,
            reported,
            received,
        )
    seq.out.completion_tokens += reported - received


def _chunks(buffer: bytearray, backend: Backend) -> Iterator[dict[str, Any]]:
    for event in split_events(buffer):
        payload = event_data(event)
        if payload is None or payload == b"[DONE]":
            continue
        chunk = json.loads(payload)
        if not isinstance(chunk, dict):
            raise UpstreamFailed(backend, "stream chunk is not an object")
        yield chunk


async def _tokenize(seq: PdSequence, backend: Backend, body: dict[str, Any]) -> list[int]:
    """Token ids from the engine's own ``/tokenize`` (vLLM's tokenizer and chat template)."""
    with seq.trace.engine_call(backend.role, backend.url, "tokenize") as span:
        data = await call_json(
            backend.pool,
            "/tokenize",
            body,
            within=backend.timeouts.first_byte,
            what="/tokenize",
            headers=span.headers,
        )
    try:
        return [int(t) for t in data.get("tokens") or ()]
    except (AttributeError, TypeError, ValueError):
        raise UpstreamFailed(backend, "/tokenize answered without token ids") from None


async def resume_stream(seq: PdSequence, failed: Backend, why: str) -> bool:
    """A gpu-only or cpu-only stream whose engine died: continue it on the other engine.

    The router does not know the token ids of a passthrough stream, so the text relayed so
    far is tokenized again by the other engine (its ``/tokenize``: the same tokenizer and chat
    template) and decoded on from there; the client's stream goes on with the same id.
    Returns False (the caller then ends the stream with an error event) when the policy does
    not allow the other engine, it is down, or the relayed bytes end inside an event."""
    out, req = seq.out, seq.req
    other = seq.cpu if failed is seq.gpu else seq.gpu
    knobs = seq.knobs()
    refused = None
    if other is None or not other.available(time.monotonic()):
        refused = "no other engine is available"
    elif other is seq.cpu and not cpu_allowed(knobs):
        refused = f"the policy ({knobs.mode}) keeps the CPU out"
    elif other is seq.gpu and knobs.mode == Mode.CPU_ONLY:
        refused = "the policy is cpu-only"
    if refused is not None or other is None:
        log.info("%s: not resumed after %s: %s", out.request_id, why, refused)
        return False
    if (req.body.get("n") or 1) > 1:
        return False  # several choices' texts cannot be continued as one
    relayed = b"".join(out.relayed)
    if relayed and not relayed.endswith(b"\n\n"):
        return False  # the client holds half an event: nothing can follow it cleanly
    text, finish = [], None
    buffer = bytearray(relayed)
    try:
        for chunk in _chunks(buffer, failed):
            if "id" in chunk:
                out.keep_id(str(chunk["id"]), int(chunk.get("created") or 0))
            for choice in chunk.get("choices") or []:
                if req.chat:
                    text.append((choice.get("delta") or {}).get("content") or "")
                else:
                    text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    except (UpstreamFailed, ValueError):
        return False
    if finish is not None:
        out.finish_reason = str(finish)  # only the tail was lost
        return True
    body = req.body
    try:
        if req.chat:
            prompt_ids = await _tokenize(
                seq,
                other,
                {
                    "model": req.model,
                    "messages": body["messages"],
                    "add_generation_prompt": True,
                },
            )
        elif isinstance(body.get("prompt"), list) and all(
            isinstance(t, int) for t in body["prompt"]
        ):
            prompt_ids = list(body["prompt"])
        else:
            prompt_ids = await _tokenize(seq, other, {"model": req.model, "prompt": body["prompt"]})
        so_far = "".join(text)
        generated = (
            await _tokenize(
                seq, other, {"model": req.model, "prompt": so_far, "add_special_tokens": False}
            )
            if so_far
            else []
        )
    except UpstreamFailed as exc:
        log.warning("%s: cannot resume on the %s engine: %s", out.request_id, other.role, exc)
        return False
    log.warning(
        "%s: %s engine failed after %d tokens (%d characters; %s); resuming on the %s engine",
        out.request_id,
        failed.role,
        len(generated),
        len(so_far),
        why,
        other.role,
    )
    seq.metrics.fallback(f"{failed.role}-stream-to-{other.role}")
    pd = VllmPd(seq)
    pd.prompt_ids, pd.generated = prompt_ids, generated
    out.prompt_tokens = len(prompt_ids)
    out.completion_tokens = len(generated)
    out.pieces.append(so_far)
    try:
        out.finish_reason, _ = await pd.decode(other, 0, "resume")
    except UpstreamFailed as exc:
        seq.record_failure(other, exc)
        return False
    return True
