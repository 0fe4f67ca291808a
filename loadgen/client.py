"""The streaming OpenAI client: one request in, one timed ``RequestRecord`` out.

The timed request goes through ``wire`` (bare asyncio protocols): every socket read is
stamped with ``time.perf_counter()`` as it happens, and each SSE event carries the stamp of
the read that completed it, so parsing never shifts a timing. The request is serialized
before the send stamp for the same reason. aiohttp serves the untimed calls (model listing).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from common.sse import DONE_DATA, event_data, split_events
from loadgen.records import RequestRecord
from loadgen.wire import ConnectionPool, WireError, post
from loadgen.workload import RequestSpec

APIS = ("completions", "chat")
# Asks a router to pin this request to one mode (a common.policy_schema MODES value).
FORCED_MODE_HEADER = "X-Syshax-Mode"
# The router answers with the route it chose (router/request.py); recorded per request.
DECISION_HEADER = "X-Syshax-Route"
# Why the router chose it: the decider's short code (the router's REASON_HEADER).
REASON_HEADER = "X-Syshax-Reason"
_ERROR_BODY_LIMIT = 500


def api_root(base_url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` (with or without a slash) -> ``.../v1``."""
    root = base_url.strip().rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError(f"target {base_url!r} is not an http(s) URL")
    return root if root.endswith("/v1") else f"{root}/v1"


def make_session(timeout_s: float = 60.0) -> aiohttp.ClientSession:
    """A session for the untimed calls: model listing, the simulator's timings."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))


class TargetUnavailable(RuntimeError):
    """The target could not say which model it serves."""


async def discover_model(
    session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str] | None = None
) -> str:
    """The first model the target serves, from ``GET /v1/models``."""
    url = f"{api_root(base_url)}/models"
    try:
        async with session.get(url, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:_ERROR_BODY_LIMIT]
                raise TargetUnavailable(f"GET {url} answered HTTP {response.status}: {body}")
            listing = await response.json()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        raise TargetUnavailable(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models:
        raise TargetUnavailable(f"GET {url} lists no model; pass --model")
    return str(models[0]["id"])


class StreamClient:
    """Sends requests to one OpenAI-compatible target and times their streams."""

    def __init__(
        self,
        pool: ConnectionPool,
        base_url: str,
        model: str,
        *,
        api: str = "completions",
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {api!r}")
        self.pool = pool
        self.model = model
        self.api = api
        self.timeout_s = timeout_s
        self.url = f"{api_root(base_url)}/{'chat/completions' if api == 'chat' else 'completions'}"
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        """The request body: streamed, exact output length (``ignore_eos``), usage at the end."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.service_tier is not None:
            body["service_tier"] = spec.service_tier  # the router's SLO class
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Send one request and record it; never raises for a failed request."""
        record = RequestRecord(spec.index, spec.prompt_tokens, spec.max_tokens)
        body = json.dumps(self.payload(spec)).encode()
        record.sent_at = time.perf_counter()
        try:
            response = await post(self.pool, self.url, body, self.headers, self.timeout_s)
        except asyncio.CancelledError:
            record.error = "cancelled"
            raise
        except (WireError, OSError, TimeoutError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}".strip()
            return record
        record.status = response.head.status
        record.decision = response.head.headers.get(DECISION_HEADER.lower(), "")
        record.reason = response.head.headers.get(REASON_HEADER.lower(), "")
        if record.status != 200:
            text = b"".join(piece for _, piece in response.pieces).decode(errors="replace")
            record.error = f"HTTP {record.status}: {text[:_ERROR_BODY_LIMIT].strip()}"
            return record
        self._read_events(response.pieces, record)
        if not record.error and response.error:
            record.error = response.error
        if not record.error and not record.chunk_times:
            record.error = "the stream ended without a chunk of generated text"
        record.ok = not record.error
        return record

    def _read_events(self, pieces: list[tuple[float, bytes]], record: RequestRecord) -> None:
        """Apply the SSE events in arrival order; each carries its read's arrival stamp."""
        buffer = bytearray()
        for arrived, data in pieces:
            buffer += data
            # One piece may hold several events, or part of one (even half a CRLF).
            for event in split_events(buffer):
                if self._handle_event(event, arrived, record):
                    return
        if pieces:
            # The stream ended, perhaps without the blank line after its last event.
            for event in split_events(buffer, final=True):
                if self._handle_event(event, pieces[-1][0], record):
                    return

    def _handle_event(self, event: bytes, now: float, record: RequestRecord) -> bool:
        """Apply one SSE event to the record; True once the stream says it is done."""
        data = event_data(event)
        if not data:
            return False  # a comment (keep-alive ping) or a field we do not use
        if data == DONE_DATA:
            return True
        try:
            message = json.loads(data)
        except ValueError:
            record.error = f"unparseable SSE data: {data[:_ERROR_BODY_LIMIT]!r}"
            return True
        if not isinstance(message, dict):
            return False
        if not record.response_id and isinstance(message.get("id"), str):
            record.response_id = message["id"]
        if error := message.get("error"):
            detail = error.get("message", error) if isinstance(error, dict) else error
            record.error = f"error in stream: {detail}"
            return True
        choices = message.get("choices")
        if choices:
            choice = choices[0]
            text = (
                choice.get("text")
                if self.api == "completions"
                else ((choice.get("delta") or {}).get("content"))
            )
            if text:
                record.chunk_times.append(now)
        usage = message.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                record.usage_output_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                record.prompt_tokens = usage["prompt_tokens"]
        return False
