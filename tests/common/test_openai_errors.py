"""OpenAI's error envelope, the one the router and the Batch API both answer with."""

from __future__ import annotations

import json

from common.openai_errors import openai_error


def test_the_envelope_keeps_openais_key_order_and_null_fields() -> None:
    body = openai_error("No file with id 'f'", type_="invalid_request_error", code="not_found")
    assert json.dumps(body) == (
        '{"error": {"message": "No file with id \'f\'", "type": "invalid_request_error", '
        '"param": null, "code": "not_found"}}'
    )
