"""OpenAI's error answer, ``{"error": {"message", "type", "param", "code"}}``, built in one place.

The router's answers to its clients (router/client/errors.py) and the control plane's Batch API
(controlplane/batches/shapes.py) both fail in this shape, the one OpenAI's SDKs read. The keys
keep this order and ``param`` and ``code`` stay present as null, so both answer byte for byte
what they always have (docs/decisions/0060-distinct-names-and-one-openai-error.md).
"""

from __future__ import annotations

from typing import TypeAlias

# {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}
OpenAIErrorBody: TypeAlias = dict[str, dict[str, str | None]]


def openai_error(
    message: str, *, type_: str, code: str | None = None, param: str | None = None
) -> OpenAIErrorBody:
    """The envelope of one error, ready for ``json.dumps``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
