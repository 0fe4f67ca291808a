"""An input file's lines checked one by one, with no I/O: each line is a request or the
reason it is not (its line number, custom_id and the field at fault).

A line of a batch input file, as OpenAI defines it::

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...]}}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_CUSTOM_ID = 512


class TooManyLines(Exception):
    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"the input file has {count} requests; the limit is {limit} a batch")
        self.count = count
        self.limit = limit


@dataclass(frozen=True)
class LineError:
    code: str
    message: str
    param: str | None
    line: int

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class ParsedLine:
    line_no: int
    custom_id: str
    body: dict[str, Any] | None
    error: LineError | None = None


def count_requests(content: bytes) -> int:
    return sum(1 for raw in content.splitlines() if raw.strip())


def parse_input(
    content: bytes,
    *,
    endpoint: str,
    allows_model: Callable[[str], bool],
    max_lines: int,
) -> list[ParsedLine]:
    """Every non-blank line of ``content``, parsed; raises TooManyLines over ``max_lines``."""
    count = count_requests(content)
    if count > max_lines:
        raise TooManyLines(count, max_lines)
    seen: set[str] = set()
    parsed: list[ParsedLine] = []
    for line_no, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        parsed.append(_parse_line(raw, line_no, endpoint, allows_model, seen))
    return parsed


class _Bad(Exception):
    def __init__(self, code: str, param: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.message = message


def _parse_line(
    raw: bytes,
    line_no: int,
    endpoint: str,
    allows_model: Callable[[str], bool],
    seen: set[str],
) -> ParsedLine:
    custom_id = ""
    try:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise _Bad("invalid_json", None, f"not a JSON object: {exc}") from None
        if not isinstance(data, dict):
            raise _Bad("invalid_json", None, "must be a JSON object")
        value = data.get("custom_id")
        if not isinstance(value, str) or not value:
            raise _Bad("invalid_custom_id", "custom_id", "must be a non-empty string")
        if len(value) > MAX_CUSTOM_ID:
            raise _Bad("invalid_custom_id", "custom_id", f"is over {MAX_CUSTOM_ID} characters long")
        custom_id = value
        if custom_id in seen:
            raise _Bad(
                "duplicate_custom_id",
                "custom_id",
                f"{custom_id!r} is used by an earlier line; each must be unique in the file",
            )
        seen.add(custom_id)
        body = _check_request(data, endpoint, allows_model)
    except _Bad as bad:
        where = f"line {line_no}" + (f" (custom_id {custom_id!r})" if custom_id else "")
        field = f" {bad.param}" if bad.param else ""
        error = LineError(bad.code, f"{where}:{field} {bad.message}", bad.param, line_no)
        return ParsedLine(line_no, custom_id, None, error)
    return ParsedLine(line_no, custom_id, body)


def _check_request(
    data: dict[str, Any], endpoint: str, allows_model: Callable[[str], bool]
) -> dict[str, Any]:
    if data.get("method") != "POST":
        raise _Bad("invalid_method", "method", f"must be 'POST'; got {data.get('method')!r}")
    if data.get("url") != endpoint:
        raise _Bad(
            "mismatched_url",
            "url",
            f"must be the batch's endpoint {endpoint!r}; got {data.get('url')!r}",
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise _Bad("invalid_body", "body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _Bad("invalid_model", "body.model", "must be a non-empty string")
    if not allows_model(model):
        raise _Bad("model_not_allowed", "body.model", f"this key may not use model {model!r}")
    if body.get("stream"):
        raise _Bad("invalid_stream", "body.stream", "a batch request cannot stream")
    return body
