"""An input file's lines checked one by one, with no I/O: each line is a request or the
reason it is not (its line number, custom_id and the field at fault).

A line of a batch input file, as OpenAI defines it::

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...]}}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

MAX_CUSTOM_ID = 512
# Deepest nesting of arrays and objects a line may have. Deeper JSON is no request a model
# serves, and it would overflow the stack of whatever parses or stores it next.
MAX_NESTING = 100

log = logging.getLogger(__name__)


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


def split_lines(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a file that comes in ``pieces`` cut anywhere (its stored chunks), each
    without its ``\n`` or ``\r\n``; only the line being read is held whole."""
    partial = b""
    for piece in pieces:
        lines = (partial + piece).split(b"\n")
        partial = lines.pop()
        for raw in lines:
            yield raw[:-1] if raw.endswith(b"\r") else raw
    if partial:
        yield partial[:-1] if partial.endswith(b"\r") else partial


def parse_input(
    lines: Iterable[bytes],
    *,
    endpoint: str,
    allows_model: Callable[[str], bool],
    max_lines: int,
) -> list[ParsedLine]:
    """Every non-blank line, parsed; raises TooManyLines over ``max_lines`` (after counting
    the rest, which it does not parse)."""
    seen: set[str] = set()
    parsed: list[ParsedLine] = []
    count = 0
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        count += 1
        if count <= max_lines:
            parsed.append(_parse_line(raw, line_no, endpoint, allows_model, seen))
    if count > max_lines:
        raise TooManyLines(count, max_lines)
    return parsed


def nesting(value: Any) -> int:
    """How deep ``value``'s arrays and objects nest, without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


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
        except RecursionError:
            raise _Bad("too_deeply_nested", None, _too_deep()) from None
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
        if nesting(data) > MAX_NESTING:
            raise _Bad("too_deeply_nested", None, _too_deep())
        body = _check_request(data, endpoint, allows_model)
    except _Bad as bad:
        return _failed(line_no, custom_id, bad)
    except Exception as exc:  # a bug, or input nobody foresaw: this line fails, not the file
        log.exception("checking line %s of a batch input file", line_no)
        unforeseen = _Bad("unreadable_line", None, f"could not be checked ({type(exc).__name__})")
        return _failed(line_no, custom_id, unforeseen)
    return ParsedLine(line_no, custom_id, body)


def _too_deep() -> str:
    return f"nests arrays and objects over {MAX_NESTING} levels deep"


def _failed(line_no: int, custom_id: str, bad: _Bad) -> ParsedLine:
    where = f"line {line_no}" + (f" (custom_id {custom_id!r})" if custom_id else "")
    field = f" {bad.param}" if bad.param else ""
    error = LineError(bad.code, f"{where}:{field} {bad.message}", bad.param, line_no)
    return ParsedLine(line_no, custom_id, None, error)


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
