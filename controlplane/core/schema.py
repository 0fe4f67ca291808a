"""The OpenAPI schema documents the errors the API really answers, in its one error shape.

drf-spectacular documents only the success of each operation. This post-processing hook adds
``Error`` (``{"error": {"code", "message", "fields"}}``, core/api.py) under every 4xx an operation
can give: 400 where it takes parameters or a body, 401 and 403 where it needs credentials, 404
where its path names an object, 409 where it deletes or changes state, 413 where it takes a
body, and 429 for callers the API rate-limits. A client, or schemathesis in ``make test``, can
then check every answer against the schema.
"""

from __future__ import annotations

from typing import Any

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "fields": {"type": "object", "additionalProperties": True},
            },
            "required": ["code", "message"],
        }
    },
    "required": ["error"],
}
REASONS = {
    400: "The input is wrong; the message names the field and the limit",
    401: "No valid credentials",
    403: "The credentials may not do this",
    404: "No such object, or not one these credentials may see",
    409: "The object's state or its references forbid this now",
    413: "The body is larger than the API accepts",
    429: "Too many requests from this credential; retry after Retry-After seconds",
}
METHODS = ("get", "put", "post", "patch", "delete")


def _codes(method: str, operation: dict[str, Any]) -> set[int]:
    parameters = operation.get("parameters") or []
    codes = set()
    if operation.get("security") != [] and operation.get("security") != [{}]:
        codes |= {401, 403, 429}
    if parameters or "requestBody" in operation:
        codes.add(400)
    if any(p.get("in") == "path" for p in parameters):
        codes.add(404)
    if method in ("post", "put", "patch", "delete"):
        codes.add(409)
    if "requestBody" in operation:
        codes.add(413)
    return codes


def document_errors(result: dict[str, Any], generator: Any, request: Any, public: bool) -> Any:
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    ref = {"$ref": "#/components/schemas/Error"}
    for path_item in result.get("paths", {}).values():
        for method in METHODS:
            operation = path_item.get(method)
            if operation is None:
                continue
            responses = operation.setdefault("responses", {})
            for code in sorted(_codes(method, operation)):
                responses.setdefault(
                    str(code),
                    {
                        "description": REASONS[code],
                        "content": {"application/json": {"schema": ref}},
                    },
                )
    return result
