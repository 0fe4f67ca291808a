"""The API's JSON parser."""

from __future__ import annotations

import re
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

# The characters PostgreSQL's text and jsonb cannot hold.
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def unstorable_text(value: Any) -> bool:
    """Whether any string in a parsed JSON document (keys included) holds U+0000 or a lone
    surrogate (``\\ud800``-``\\udfff``, which JSON's escapes can spell but no UTF-8 encodes)."""
    if isinstance(value, str):
        return UNSTORABLE.search(value) is not None
    if isinstance(value, dict):
        return any(unstorable_text(k) or unstorable_text(v) for k, v in value.items())
    if isinstance(value, list):
        return any(unstorable_text(v) for v in value)
    return False


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, refusing the NUL character (``\\u0000``) and lone surrogates in any
    string: PostgreSQL's text and jsonb cannot hold them, so they would otherwise fail as a
    server error in the write that stores them (found by
    tests/controlplane/core/test_api_fuzz.py and
    tests/controlplane/gateway/test_gateway_readers.py)."""

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        data = super().parse(stream, media_type, parser_context)
        if unstorable_text(data):
            raise ParseError(
                "JSON strings may not contain the NUL character (\\u0000) nor a lone"
                " surrogate (\\ud800-\\udfff)"
            )
        return data
