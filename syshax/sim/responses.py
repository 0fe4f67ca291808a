"""Response bodies and SSE chunks in the shapes vLLM's OpenAI server produces."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from syshax.sim.scheduler import Sequence

_MARK = "\x00"


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def chunk_header(kind: str, rid: str, created: int, model: str) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model}


def token_template(kind: str, rid: str, created: int, model: str) -> tuple[bytes, bytes]:
    """(prefix, suffix) around a token's text in its SSE event, built once per stream.

    Generated tokens are plain ASCII words, so the text goes between them unescaped.
    """
    head = chunk_header(kind, rid, created, model)
    if kind == "chat":
        choice = {"index": 0, "delta": {"content": _MARK}, "logprobs": None, "finish_reason": None}
    else:
        choice = {
            "index": 0,
            "text": _MARK,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
    text = dumps({**head, "choices": [choice]})
    before, after = text.split(json.dumps(_MARK), 1)
    return f'data: {before}"'.encode(), f'"{after}\n\n'.encode()


def role_chunk(rid: str, created: int, model: str) -> bytes:
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return sse({**chunk_header("chat", rid, created, model), "choices": [choice]})


def finish_chunk(kind: str, rid: str, created: int, model: str, reason: str) -> bytes:
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
    return sse({**chunk_header(kind, rid, created, model), "choices": [choice]})


def usage_chunk(
    kind: str, rid: str, created: int, model: str, prompt: int, completion: int
) -> bytes:
    return sse(
        {
            **chunk_header(kind, rid, created, model),
            "choices": [],
            "usage": usage(prompt, completion),
        }
    )


def full_response(
    kind: str,
    rid: str,
    created: int,
    model: str,
    text: str,
    reason: str,
    prompt: int,
    completion: int,
) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "tool_calls": [],
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(prompt, completion),
        "prompt_logprobs": None,
    }


class StreamSink:
    """Writes each token straight to the socket as one HTTP chunk (no task switch per token)."""

    __slots__ = ("done", "emitted_times", "prefix", "suffix", "transport")

    def __init__(self, transport: asyncio.Transport | None, prefix: bytes, suffix: bytes) -> None:
        self.transport = transport
        self.prefix = prefix
        self.suffix = suffix
        self.emitted_times: list[float] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_token(self, seq: Sequence, text: str) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        payload = self.prefix + text.encode() + self.suffix
        transport.write(b"%x\r\n%b\r\n" % (len(payload), payload))
        self.emitted_times.append(time.time())
        return True

    def on_finish(self, seq: Sequence) -> None:
        if not self.done.done():
            self.done.set_result(None)


class CollectSink:
    """Gathers the text of a non-streaming request."""

    __slots__ = ("done", "emitted_times", "parts", "transport")

    def __init__(self, transport: asyncio.Transport | None) -> None:
        self.transport = transport
        self.parts: list[str] = []
        self.emitted_times: list[float] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_token(self, seq: Sequence, text: str) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        self.parts.append(text)
        self.emitted_times.append(time.time())
        return True

    def on_finish(self, seq: Sequence) -> None:
        if not self.done.done():
            self.done.set_result(None)
