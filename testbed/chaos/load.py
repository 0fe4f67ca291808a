"""A steady client load on the router: N closed-loop streams, each checked end to end.

A request counts as a client-visible error when the answer is not 200, when the stream breaks
(connection reset, timeout, no ``[DONE]``), when it carries an error event, or when it ends
with fewer tokens than asked for (``ignore_eos``: an engine that died and was not resumed
would end it early). Everything the client would not notice (a fallback, a resume on the other
engine) is not an error: that is the point of measuring from here.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx


@dataclass
class ClientError:
    t: float  # monotonic
    kind: str
    detail: str


@dataclass
class LoadStats:
    requests: int = 0
    ok: int = 0
    errors: list[ClientError] = field(default_factory=list)
    routes: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "ok": self.ok,
            "errors": len(self.errors),
            "routes": dict(self.routes),
            "error_samples": [f"{e.kind}: {e.detail}" for e in self.errors[:5]],
        }


class LoadClient:
    def __init__(
        self,
        router_url: str,
        model: str,
        *,
        clients: int,
        max_tokens: int,
        mode: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.url = f"{router_url}/v1/completions"
        self.model, self.clients, self.max_tokens = model, clients, max_tokens
        self.headers = {"X-Syshax-Mode": mode} if mode else {}
        self.timeout = timeout
        self.stats = LoadStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> LoadClient:
        for index in range(self.clients):
            thread = threading.Thread(target=self._loop, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + 5)

    def _loop(self, index: int) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                self._one(client, f"client {index} request {n}: explain prefill and decode")

    def _one(self, client: httpx.Client, prompt: str) -> None:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        error: tuple[str, str] | None = None
        route = "?"
        try:
            with client.stream("POST", self.url, json=body, headers=self.headers) as response:
                route = response.headers.get("X-Syshax-Route", "?")
                if response.status_code != 200:
                    response.read()
                    error = (f"http {response.status_code}", response.text[:200])
                else:
                    error = self._check_stream(response)
        except httpx.HTTPError as exc:
            error = ("broken stream", f"{type(exc).__name__}: {exc}"[:200])
        with self._lock:
            self.stats.requests += 1
            self.stats.routes[route] += 1
            if error is None:
                self.stats.ok += 1
            else:
                self.stats.errors.append(ClientError(time.monotonic(), *error))
        if error is not None:
            time.sleep(0.2)  # a client backs off a little before it tries again

    def _check_stream(self, response: httpx.Response) -> tuple[str, str] | None:
        done = False
        completion_tokens = None
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                return ("error event", json.dumps(event["error"])[:200])
            usage = event.get("usage")
            if usage:
                completion_tokens = usage.get("completion_tokens")
        if not done:
            return ("broken stream", "ended without [DONE]")
        if completion_tokens is not None and completion_tokens < self.max_tokens:
            return ("short answer", f"{completion_tokens} of {self.max_tokens} tokens")
        return None
