"""The API's JSON parser."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


def has_nul(value: Any) -> bool:
    """Whether any string in a parsed JSON document (keys included) holds U+0000."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(has_nul(k) or has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_nul(v) for v in value)
    return False


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, refusing the NUL character (``\\u0000``) in any string: PostgreSQL's
    text and jsonb cannot hold it, so it would otherwise fail as a server error in the write
    that stores it (found by tests/controlplane/test_api_fuzz.py)."""

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        data = super().parse(stream, media_type, parser_context)
        if has_nul(data):
            raise ParseError("JSON strings may not contain the NUL character (\\u0000)")
        return data
