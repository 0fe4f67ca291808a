"""Response bodies and SSE chunks in the shapes vLLM 0.32's OpenAI server produces.

Streams: one chunk per token, the last one carrying ``finish_reason`` (and the
``system_fingerprint`` when no usage chunk follows); chat starts with a role chunk that
carries ``prompt_token_ids``, completions put them on the first token's chunk. Every token
chunk is rendered from templates prebuilt per stream, so the engine's emission loop does no
JSON encoding.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from sim.scheduler import FinishReason, Sequence
from sim.tokens import VOCABULARY_BYTES, decode

# Placeholders in a chunk's JSON; their encoded form is cut out and the value put in its place.
_TEXT = "\x00text"
_REASON = "\x00reason"
_ID = -7340033
_ID_BYTES = [str(i).encode() for i in range(len(VOCABULARY_BYTES))]


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


def prompt_details(kind: str, cached: int, *, stream: bool) -> dict[str, Any]:
    """``usage.prompt_tokens_details`` as each of vLLM's four code paths writes it."""
    details: dict[str, Any] = {"cached_tokens": cached}
    if kind == "chat":
        details["created_cache_tokens"] = 0  # vLLM 0.32 reports 0 here too
    if not stream:
        details.setdefault("created_cache_tokens", None)
        details["multimodal_tokens"] = None
    return details


def usage(
    kind: str, prompt: int, completion: int, cached: int | None, *, stream: bool
) -> dict[str, Any]:
    """``cached`` is None when the engine runs without --enable-prompt-tokens-details."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if cached is not None:
        body["prompt_tokens_details"] = prompt_details(kind, cached, stream=stream)
    elif not stream:
        body["prompt_tokens_details"] = None
    if not stream:
        body["completion_tokens_details"] = None
    return body


def chunk_header(kind: str, rid: str, created: int, model: str) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


class Template:
    """A chunk's bytes with holes for the token text, the finish reason and the token id
    (each hole only where the chunk has that field, always in that order)."""

    __slots__ = ("holes", "parts")

    def __init__(self, obj: dict[str, Any]) -> None:
        text = f"data: {dumps(obj)}\n\n"
        parts = []
        holes = ""
        for hole, mark in (("t", dumps(_TEXT)[1:-1]), ("r", dumps(_REASON)[1:-1]), ("i", str(_ID))):
            if mark in text:
                before, text = text.split(mark, 1)
                parts.append(before.encode())
                holes += hole
        parts.append(text.encode())
        self.parts = parts
        self.holes = holes

    def render(self, text: bytes, reason: bytes, token: bytes) -> bytes:
        p = self.parts
        holes = self.holes
        if holes == "ti":
            return p[0] + text + p[1] + token + p[2]
        if holes == "t":
            return p[0] + text + p[1]
        if holes == "tri":
            return p[0] + text + p[1] + reason + p[2] + token + p[3]
        return p[0] + text + p[1] + reason + p[2]  # "tr"


@dataclass
class StreamFormat:
    """Everything a stream's chunks depend on, fixed when the stream starts."""

    kind: str
    rid: str
    created: int
    model: str
    fingerprint: str
    return_token_ids: bool
    include_usage: bool
    prompt_ids: list[int]

    def _choice(self, *, final: bool, first: bool) -> dict[str, Any]:
        token_ids = [_ID] if self.return_token_ids else None
        reason = _REASON if final else None
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": _TEXT},
                "logprobs": None,
                "finish_reason": reason,
            }
            if final:
                choice["stop_reason"] = None
            choice["token_ids"] = token_ids
            return choice
        return {
            "index": 0,
            "text": _TEXT,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
            "prompt_token_ids": self.prompt_ids if first and self.return_token_ids else None,
            "token_ids": token_ids,
        }

    def template(self, *, final: bool, first: bool) -> Template:
        obj = {**self.header(), "choices": [self._choice(final=final, first=first)]}
        if final and not self.include_usage:
            obj["system_fingerprint"] = self.fingerprint
        return Template(obj)

    def header(self) -> dict[str, Any]:
        return chunk_header(self.kind, self.rid, self.created, self.model)

    def role_chunk(self) -> bytes:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        prompt = self.prompt_ids if self.return_token_ids else None
        return sse({**self.header(), "choices": [choice], "prompt_token_ids": prompt,
                    "prompt_text": None})  # fmt: skip

    def finish_chunk(self, reason: str) -> bytes:
        """A finish without a token (a sysHAX chunk that publishes its KV first)."""
        choice = self._choice(final=True, first=False)
        if self.kind == "chat":
            choice["delta"] = {"content": ""}
        else:
            choice["text"] = ""
        choice["finish_reason"] = reason
        choice["token_ids"] = [] if self.return_token_ids else None
        obj = {**self.header(), "choices": [choice]}
        if not self.include_usage:
            obj["system_fingerprint"] = self.fingerprint
        return sse(obj)

    def usage_chunk(self, prompt: int, completion: int, cached: int | None) -> bytes:
        return sse(
            {
                **self.header(),
                "choices": [],
                "usage": usage(self.kind, prompt, completion, cached, stream=True),
                "system_fingerprint": self.fingerprint,
            }
        )


def full_response(
    fmt: StreamFormat,
    token_ids: list[int],
    reason: str,
    usage_body: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    text = decode(token_ids)
    ids = list(token_ids) if fmt.return_token_ids else None
    prompt_ids = fmt.prompt_ids if fmt.return_token_ids else None
    if fmt.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
            "token_ids": ids,
            "routed_experts": None,
        }
        head = {"id": fmt.rid, "object": "chat.completion", "created": fmt.created}
        tail: dict[str, Any] = {
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "prompt_text": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
            "token_ids": ids,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "routed_experts": None,
        }
        head = {"id": fmt.rid, "object": "text_completion", "created": fmt.created}
        tail = {}
    return {
        **head,
        "model": fmt.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fmt.fingerprint,
        "usage": usage_body,
        **tail,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


class StreamSink:
    """Writes each token straight to the socket as one HTTP chunk (no task switch per token).

    ``defer_scheduled``: a token that ends a sysHAX chunk goes out as an ordinary token; the
    server sends the finish after publishing the KV, so a client never sees "scheduled"
    before the segment exists.
    """

    __slots__ = (
        "_final",
        "_first",
        "_first_final",
        "_middle",
        "defer_scheduled",
        "done",
        "emitted_times",
        "started",
        "transport",
    )

    def __init__(
        self, transport: asyncio.Transport | None, fmt: StreamFormat, defer_scheduled: bool
    ) -> None:
        self.transport = transport
        self._middle = fmt.template(final=False, first=False)
        self._final = fmt.template(final=True, first=False)
        self._first = fmt.template(final=False, first=True)
        self._first_final = fmt.template(final=True, first=True)
        self.defer_scheduled = defer_scheduled
        self.started = False
        self.emitted_times: list[float] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_token(self, seq: Sequence, token: int) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        reason = seq.finish_reason
        final = reason is not None and not (
            self.defer_scheduled and reason == FinishReason.SCHEDULED
        )
        if self.started:
            template = self._final if final else self._middle
        else:
            template = self._first_final if final else self._first
            self.started = True
        reason_bytes = reason.value.encode() if final and reason is not None else b""
        payload = template.render(VOCABULARY_BYTES[token], reason_bytes, _ID_BYTES[token])
        transport.write(b"%x\r\n%b\r\n" % (len(payload), payload))
        self.emitted_times.append(time.time())
        return True

    def on_finish(self, seq: Sequence) -> None:
        if not self.done.done():
            self.done.set_result(None)


class CollectSink:
    """Gathers the token ids of a non-streaming request."""

    __slots__ = ("done", "emitted_times", "token_ids", "transport")

    def __init__(self, transport: asyncio.Transport | None) -> None:
        self.transport = transport
        self.token_ids: list[int] = []
        self.emitted_times: list[float] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_token(self, seq: Sequence, token: int) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        self.token_ids.append(token)
        self.emitted_times.append(time.time())
        return True

    def on_finish(self, seq: Sequence) -> None:
        if not self.done.done():
            self.done.set_result(None)
