"""Server-sent events: building the client's spliced stream (reading upstream events is
common.sse).

When the router stitches one client stream out of several upstream requests (GPU prefill,
CPU decode chunks, a GPU resume) it emits its own chunks with one id, one role chunk, one
finish chunk and one usage chunk, so the seams are invisible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.openai_errors import openai_error

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ChunkParts:
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    role_only: bool


def chunk_parts(chunk: dict[str, Any], chat: bool) -> ChunkParts:
    """The text, finish reason and usage carried by one upstream stream chunk."""
    choices = chunk.get("choices") or []
    text = ""
    finish = None
    role_only = False
    if choices:
        choice = choices[0]
        if chat:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            role_only = "role" in delta and not text
        else:
            text = choice.get("text") or ""
        finish = choice.get("finish_reason")
    usage = chunk.get("usage")
    return ChunkParts(text, finish, usage if isinstance(usage, dict) else None, role_only)


class ChunkBuilder:
    """Builds the client-facing chunks of one spliced stream (chat or completions)."""

    def __init__(self, *, chat: bool, request_id: str, model: str, created: int) -> None:
        self.chat = chat
        self.base: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        # Token chunks are the hot path: encode everything but the text once.
        marker = "\u0000TEXT\u0000"
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": marker}}
        else:
            choice = {"index": 0, "text": marker}
        choice.update(logprobs=None, finish_reason=None)
        template = self._encode([choice])
        quoted = json.dumps(marker).encode()
        self._prefix, _, self._suffix = template.partition(quoted)

    def _encode(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = dict(self.base, choices=choices, **extra)
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def role(self) -> bytes:
        assert self.chat
        delta = {"role": "assistant", "content": ""}
        return self._encode([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def text(self, text: str) -> bytes:
        return self._prefix + json.dumps(text).encode() + self._suffix

    def text_with_ids(self, text: str, token_ids: list[int]) -> bytes:
        """A text chunk that also carries its token ids (vLLM's ``return_token_ids``)."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=None, token_ids=token_ids)
        return self._encode([choice])

    def finish(self, reason: str) -> bytes:
        if self.chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
        return self._encode([choice])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._encode([], usage=usage_dict(prompt_tokens, completion_tokens))

    def error(self, message: str, code: str) -> bytes:
        body = openai_error(message, type_="server_error", code=code)
        return b"data: " + json.dumps(body).encode() + b"\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    *,
    chat: bool,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A non-streaming response assembled from spliced pieces."""
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_dict(prompt_tokens, completion_tokens),
    }
