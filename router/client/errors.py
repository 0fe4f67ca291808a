"""OpenAI-shaped errors: every failure a client sees goes through here, never a stack trace."""

from __future__ import annotations

import json

from aiohttp import web

from common.openai_errors import OpenAIErrorBody, openai_error


class RouterError(Exception):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> OpenAIErrorBody:
        return openai_error(self.message, type_=self.type_, code=self.code, param=self.param)


def error_response(err: RouterError) -> web.Response:
    headers = {}
    if err.retry_after is not None:
        # Retry-After takes whole seconds; round up so a client never retries too early.
        headers["Retry-After"] = str(max(1, int(-(-err.retry_after // 1))))
    return web.Response(
        status=err.status,
        body=json.dumps(err.body()).encode(),
        content_type="application/json",
        headers=headers,
    )


def bad_request(
    message: str, *, param: str | None = None, code: str = "invalid_value"
) -> RouterError:
    return RouterError(400, message, param=param, code=code)


def unavailable(message: str, *, retry_after: float = 1.0) -> RouterError:
    return RouterError(
        503,
        message,
        type_="service_unavailable",
        code="backend_unavailable",
        retry_after=retry_after,
    )


def saturated(message: str, *, retry_after: float = 1.0) -> RouterError:
    return RouterError(
        429, message, type_="rate_limit_exceeded", code="saturated", retry_after=retry_after
    )
