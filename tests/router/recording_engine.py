"""An engine stand-in that records every request the router sends it: the method, the path,
the headers and the JSON body. It speaks enough of vLLM's API for every route the router
takes - passthrough (streamed or not, chat or completions), the vllm PD protocol's prefill
and decode, the catch-all paths - and reports the load a test sets on its ``/metrics``.

It runs an aiohttp server on an event loop in a thread of its own, so a test drives a
router process in front of it with plain blocking calls.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from router_procs import MODEL

TRANSFER = {"transfer_id": "t-recorded", "num_tokens": 3, "lease_expires_at": 0}
PROMPT_IDS = [11, 12, 13]


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: Any  # the JSON body, None when there was none


class RecordingEngine:
    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.running = 0
        self.waiting = 0
        self.fail = False  # answer every completion with HTTP 500
        self.hold = False  # streams stop after their first token until release()
        self.tokens_per_chunk = 1  # tokens in each streamed chunk (vLLM batches them when behind)
        self.die_after: int | None = None  # the next stream is cut after this many chunks
        # Usage on every chunk when asked (vLLM's stream_options.continuous_usage_stats).
        self.continuous_usage = True
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner = self._call(self._start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self) -> web.AppRunner:
        self._released = asyncio.Event()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_route("*", "/{tail:.*}", self._other)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    def release(self) -> None:
        """Held streams go on to their end."""
        self._loop.call_soon_threadsafe(self._released.set)

    def close(self) -> None:
        self._call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def requests(self) -> list[Seen]:
        """What the router sent, scrapes left out."""
        with self._lock:
            return list(self.seen)

    async def _record(self, request: web.Request) -> Any:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        headers = {name.lower(): value for name, value in request.headers.items()}
        with self._lock:
            self.seen.append(Seen(request.method, request.path_qs, headers, body))
        return body

    async def _metrics(self, request: web.Request) -> web.Response:
        page = (
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}.0\n'
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting}.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n'
        )
        return web.Response(text=page)

    async def _other(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        if request.path == "/tokenize":
            return web.json_response({"tokens": PROMPT_IDS, "count": len(PROMPT_IDS)})
        if request.path == "/version":
            return web.json_response({"version": "recording"})
        # Whatever else an engine serves (its admin paths among them) answers here.
        return web.json_response({"engine": "answered", "body": body})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if self.fail:
            error = {"message": "engine failed", "type": "server_error", "code": 500}
            return web.json_response({"error": error}, status=500)
        chat = request.path.endswith("/chat/completions")
        tokens = int(body.get("max_tokens") or 3)
        # sysHAX's segments: num_decode_tokens (0: the prefill's one), "scheduled" until the end.
        segment = body.get("num_decode_tokens")
        end = "length"
        if segment is not None and max(1, segment) < tokens:
            tokens, end = max(1, segment), "scheduled"
        params = body.get("kv_transfer_params") or {}
        n = int(body.get("n") or 1)
        if not body.get("stream"):
            return web.json_response(_answer(chat, tokens, params, end))
        options = body.get("stream_options") or {}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent, chunks = 0, 0
        while sent < tokens:
            size = min(self.tokens_per_chunk, tokens - sent)
            sent += size
            for index in range(n):
                chunk = _chunk(chat, end if sent == tokens else None, size, index)
                if self.continuous_usage and options.get("continuous_usage_stats"):
                    chunk["usage"] = _usage(sent * n)
                await response.write(_event(chunk))
            chunks += 1
            if self.die_after is not None and chunks >= self.die_after:
                self.die_after = None
                assert request.transport is not None
                request.transport.close()  # the engine dies mid-stream
                return response
            if self.hold:
                await self._released.wait()
        if options.get("include_usage"):
            cached = TRANSFER["num_tokens"] if params.get("transfer_id") else 0
            usage = dict(_usage(tokens * n), prompt_tokens_details={"cached_tokens": cached})
            await response.write(_event({"id": "cmpl-r", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _usage(completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": len(PROMPT_IDS),
        "completion_tokens": completion,
        "total_tokens": len(PROMPT_IDS) + completion,
    }


def _chunk(chat: bool, finish: str | None, tokens: int = 1, index: int = 0) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": [7] * tokens}
    if chat:
        choice["delta"] = {"content": "tok " * tokens}
    else:
        choice["text"] = "tok " * tokens
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "cmpl-r", "object": kind, "created": 1, "model": MODEL, "choices": [choice]}


def _answer(
    chat: bool, tokens: int, params: dict[str, Any], finish: str = "length"
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish,
        "token_ids": [7] * tokens,
        "prompt_token_ids": PROMPT_IDS,
    }
    if chat:
        choice["message"] = {"role": "assistant", "content": "tok " * tokens}
    else:
        choice["text"] = "tok " * tokens
    answer: dict[str, Any] = {
        "id": "cmpl-r",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(PROMPT_IDS),
            "completion_tokens": tokens,
            "total_tokens": len(PROMPT_IDS) + tokens,
        },
    }
    if params.get("do_remote_decode"):
        answer["kv_transfer_params"] = TRANSFER  # the connector's answer to a prefill
    return answer
