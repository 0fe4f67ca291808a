"""The tokens a relayed answer used, for the tenant's token count: the engine's own usage
where the answer carries it, else counted from the relayed events."""

from __future__ import annotations

import json
from typing import Any

from common.sse import event_data, split_events
from router.client.stream import ClientStream


def _usage_pair(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion


def answer_usage(body: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of an engine's non-streaming answer; None if it has none."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return _usage_pair(data.get("usage")) if isinstance(data, dict) else None


def relayed_usage(out: ClientStream, body_bytes: int) -> tuple[int, int]:
    """(prompt, completion) tokens of a relayed stream: its usage chunk where the client
    asked for one (it may have left in a payload before the last), else the tokens counted
    from its events (their token ids where the engine sent them, else a token per text
    event of each choice) and the prompt estimated from the request's size."""
    last = b"".join(out.relayed[-2:]) + out.tail
    for payload in reversed(_payloads(last)[-3:]):
        if b'"usage"' not in payload:
            continue
        try:
            pair = _usage_pair(json.loads(payload).get("usage"))
        except (ValueError, AttributeError):
            pair = None
        if pair is not None:
            return pair
    events = _payloads(b"".join(out.relayed) + out.tail)
    return max(1, body_bytes // 4), sum(_event_tokens(payload) for payload in events)


def _payloads(stream: bytes) -> list[bytes]:
    """The data of each whole event in ``stream`` (a relayed stream from an event's start)."""
    return [
        payload
        for event in split_events(bytearray(stream), final=True)
        if (payload := event_data(event)) is not None and payload != b"[DONE]"
    ]


def _event_tokens(payload: bytes) -> int:
    """The completion tokens one relayed event carries, over all its choices."""
    try:
        choices = json.loads(payload).get("choices") or []
    except (ValueError, AttributeError):
        return 0
    tokens = 0
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            tokens += len(ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            tokens += 1
    return tokens
