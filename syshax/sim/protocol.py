"""Parsing and validating OpenAI/vLLM request bodies into one plain description.

Errors are ``ApiError`` carrying vLLM's error shape; the server turns them into responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from syshax.sim.tokens import chat_prompt_tokens, count_words


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or {
            400: "BadRequestError",
            404: "NotFoundError",
            409: "ConflictError",
            410: "GoneError",
        }.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class ParsedRequest:
    kind: Literal["chat", "completion"]
    model: str | None
    prompt_tokens: int
    prompt_key: str  # what seeds the generated tokens
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    num_decode_tokens: int | None
    request_id_inference: str | None
    generated_text: str | None
    kv_transfer_params: dict[str, Any] | None

    @property
    def resumed_tokens(self) -> int:
        return count_words(self.generated_text) if self.generated_text else 0


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


def _typed(body: dict[str, Any], name: str, types: tuple[type, ...], label: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int subclass; a JSON true is no integer.
    if isinstance(value, bool) and bool not in types:
        raise _bad(f"'{name}' must be {label}, got {json.dumps(value)}", name)
    if not isinstance(value, types):
        raise _bad(f"'{name}' must be {label}, got {type(value).__name__}", name)
    return value


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}", None) from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    return body


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise _bad(f"messages[{index}].content parts must be objects with text", "messages")
            parts.append(part.get("text", ""))
        return " ".join(parts)
    raise _bad(f"messages[{index}].content must be a string or a list of parts", "messages")


def _chat_prompt(body: dict[str, Any]) -> tuple[int, str]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    contents = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        contents.append(_content_text(msg.get("content"), i))
    return chat_prompt_tokens(contents), "\n".join(contents)


def _completion_prompt(body: dict[str, Any]) -> tuple[int, str]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return count_words(prompt), prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return len(prompt), " ".join(map(str, prompt))
    raise _bad(
        "'prompt' must be a string, a list of token ids, or a list of one of those "
        "(this engine serves one prompt per request)",
        "prompt",
    )


def parse_request(kind: Literal["chat", "completion"], body: dict[str, Any]) -> ParsedRequest:
    model = _typed(body, "model", (str,), "a string")
    if kind == "chat":
        prompt_tokens, key = _chat_prompt(body)
        max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer")
        if max_tokens is None:
            max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    else:
        prompt_tokens, key = _completion_prompt(body)
        max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _typed(body, name, (int, float), "a number")
    n = _typed(body, "n", (int,), "an integer")
    if n is not None and n != 1:
        raise _bad("this engine supports n=1 only", "n")
    stream = bool(_typed(body, "stream", (bool,), "a boolean"))
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    include_usage = bool(options.get("include_usage"))
    ignore_eos = bool(_typed(body, "ignore_eos", (bool,), "a boolean"))
    num_decode = _typed(body, "num_decode_tokens", (int,), "an integer")
    if num_decode is not None and num_decode < 0:
        raise _bad(f"num_decode_tokens must be >= 0, got {num_decode}", "num_decode_tokens")
    rid = _typed(body, "request_id_inference", (str,), "a string")
    generated = _typed(body, "generated_text", (str,), "a string")
    kv_params = _typed(body, "kv_transfer_params", (dict,), "an object")
    if rid is not None and generated is None:
        raise _bad(
            "a decode request with request_id_inference needs generated_text "
            "(all text generated so far)",
            "generated_text",
        )
    if rid is not None and num_decode is None:
        raise _bad(
            "a decode request with request_id_inference needs num_decode_tokens",
            "num_decode_tokens",
        )
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt_tokens=prompt_tokens,
        prompt_key=key,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=ignore_eos,
        num_decode_tokens=num_decode,
        request_id_inference=rid,
        generated_text=generated,
        kv_transfer_params=kv_params,
    )


def check_length(req: ParsedRequest, max_model_len: int) -> int:
    """The number of new tokens this request may generate; ApiError when it cannot fit."""
    context = req.prompt_tokens + req.resumed_tokens
    if req.max_tokens is None:
        if context >= max_model_len:
            raise _bad(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"request has {context} input tokens. Please reduce the length of the input "
                "messages.",
                "messages" if req.kind == "chat" else "prompt",
            )
        return max_model_len - context
    total = context + req.max_tokens
    if total > max_model_len:
        where = "messages" if req.kind == "chat" else "prompt"
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({context} in the {where}, {req.max_tokens} in the "
            "completion). Please reduce the length of the "
            f"{where} or completion.",
            "max_tokens",
        )
    return req.max_tokens
