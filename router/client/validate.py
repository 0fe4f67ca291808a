"""Check a client's request body before any engine sees it; each problem gets a named 400."""

from __future__ import annotations

import json
from typing import Any

from router.client.errors import RouterError, bad_request


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RouterError(
            400, f"request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_type")
    return body


def _optional_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", param=key, code="invalid_type")
    if value < minimum:
        raise bad_request(f"'{key}' must be at least {minimum}", param=key)
    return value


def check_request(body: dict[str, Any], *, chat: bool) -> tuple[str, bool, bool, int | None]:
    """Returns (model, stream, include_usage, max_tokens) or raises a 400 naming the field."""
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", param="model", code="missing_field")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", param="model", code="invalid_type")
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise bad_request("'messages' is required", param="messages", code="missing_field")
        if not isinstance(messages, list) or not messages:
            raise bad_request(
                "'messages' must be a non-empty array", param="messages", code="invalid_type"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(
                    f"'messages[{i}]' must be an object with a string 'role'",
                    param=f"messages[{i}]",
                    code="invalid_type",
                )
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("'prompt' is required", param="prompt", code="missing_field")
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(p, str | int) for p in prompt)
        )
        if not ok:
            raise bad_request(
                "'prompt' must be a string or a non-empty array",
                param="prompt",
                code="invalid_type",
            )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream", code="invalid_type")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(
                "'stream_options' must be an object", param="stream_options", code="invalid_type"
            )
        include_usage = bool(options.get("include_usage", False))
    max_tokens = _optional_int(body, "max_tokens", 1)
    max_completion = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = max_completion
    _optional_int(body, "n", 1)
    return model, stream, include_usage, max_tokens


# Fields of an engine request that only the router writes (docs/router.md, "Fields only the
# router sets"): the vLLM protocol's KV handoff, and sysHAX's PD fields (the syshax protocol).
# From a client they would hand an engine a lease, ranks or another request's KV.
ROUTER_ONLY_FIELDS = (
    "kv_transfer_params",
    "request_id_inference",
    "num_decode_tokens",
    "generated_text",
)
# vLLM copies ``vllm_xargs`` into the sampling parameters' ``extra_args``, where the KV
# connector reads ``kv_transfer_params``: the same field by another door.
EXTRA_ARGS = "vllm_xargs"


def strip_router_fields(body: dict[str, Any]) -> bool:
    """Removes the router-only fields a client sent empty (null, ``{}`` or ``""``: they ask
    for nothing) and returns whether the body changed; one that carries anything is a 400
    naming it."""
    changed = False
    for key in ROUTER_ONLY_FIELDS:
        if key not in body:
            continue
        if body[key] in (None, {}, ""):
            del body[key]
            changed = True
            continue
        raise bad_request(
            f"'{key}' is set by the router only (PD handoffs between its engines); a client "
            "request may not carry it",
            param=key,
            code="router_only_field",
        )
    extra = body.get(EXTRA_ARGS)
    if isinstance(extra, dict) and any(key in extra for key in ROUTER_ONLY_FIELDS):
        field = next(key for key in ROUTER_ONLY_FIELDS if key in extra)
        raise bad_request(
            f"'{EXTRA_ARGS}.{field}' is set by the router only; a client request may not carry it",
            param=f"{EXTRA_ARGS}.{field}",
            code="router_only_field",
        )
    return changed
