"""What a client may ask of the router: its keys, the benchmark permission, the engine paths
the catch-all forwards and the request headers that travel with them (docs/router.md,
"Access").

Two key sets: the API key (``--api-key``) lets a client in; a benchmark key
(``--benchmark-key``) lets it in too and may force a policy mode per request with
``X-Syshax-Mode``. Whether the header is honoured is the ``--mode-header`` setting:
``benchmark-keys`` (the default), ``all`` (every client that got in) or ``off`` (never).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

from aiohttp import web

from router.client.errors import RouterError

MODE_HEADER = "X-Syshax-Mode"
# Who may force a policy mode with X-Syshax-Mode; the first is the default.
MODE_HEADER_BENCHMARK_KEYS = "benchmark-keys"
MODE_HEADER_ALL = "all"
MODE_HEADER_OFF = "off"
MODE_HEADER_POLICIES = (MODE_HEADER_BENCHMARK_KEYS, MODE_HEADER_ALL, MODE_HEADER_OFF)

# The engine API paths the catch-all forwards to a GPU engine, with their methods. Anything
# else an engine serves (vLLM's /collective_rpc, /sleep, /reset_prefix_cache, LoRA loading,
# profiling ...) is an operator's, not a client's, and the engine's address came from an
# agent's report: the router answers those paths itself, with a 404.
PROXIED = {
    "/version": "GET",
    "/tokenize": "POST",
    "/detokenize": "POST",
    "/v1/embeddings": "POST",
}
# The only request headers the catch-all passes on. Never Authorization (the router's key
# is not the engine's business), Cookie, or anything hop-by-hop.
FORWARDED_HEADERS = ("Content-Type", "Accept")
# Engine response headers the catch-all does not relay (lower-case): hop-by-hop ones, those
# the router's own framing sets, and an engine's cookie, which is not for the router's clients.
NOT_RELAYED = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "set-cookie",
    )
)


def bearer(authorization: str) -> bytes:
    """The token of an ``Authorization: Bearer TOKEN`` header; empty for anything else (the
    bytes as sent: a header that is not UTF-8 is a wrong key, not an error)."""
    if not authorization.startswith("Bearer "):
        return b""
    return authorization[7:].encode("utf-8", "surrogateescape")


def key_matches(token: bytes, keys: Iterable[str]) -> bool:
    """Whether ``token`` is one of ``keys``; every key is compared, each in constant time."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key.encode())
    return found


def allowed_mode_header(
    headers: Mapping[str, str], policy: str, benchmark_keys: Iterable[str]
) -> str | None:
    """The request's ``X-Syshax-Mode`` when it may force a mode, None when it sent none or
    the router ignores it (``off``). A client without a benchmark key that sends it gets a
    403: silently serving it in another mode would make a benchmark measure the wrong thing."""
    value = headers.get(MODE_HEADER)
    if value is None or policy == MODE_HEADER_OFF:
        return None
    if policy == MODE_HEADER_ALL:
        return value
    if key_matches(bearer(headers.get("Authorization", "")), benchmark_keys):
        return value
    raise RouterError(
        403,
        f"{MODE_HEADER} needs a benchmark key (the router's --benchmark-key); this key may not "
        "force a policy mode",
        param=MODE_HEADER,
        code="mode_header_not_allowed",
    )


def raw_path_of(http: web.Request) -> str:
    """The request's path as the client sent it: before any percent-decoding or dot-segment
    handling, without the query. Every path the router serves or forwards is matched on it,
    so ``%2e%2e``, ``%2f`` and the like never name a listed path (decision record 53)."""
    return http.raw_path.partition("?")[0]


def proxied_path(method: str, raw_path: str) -> str:
    """The engine path a catch-all request goes to, or an OpenAI-shaped 404 (405 for a
    listed path asked with another method). ``raw_path`` is the client's raw path, matched
    exactly: the path sent upstream is the listed one, never the client's bytes."""
    for path, allowed in PROXIED.items():
        if raw_path != path:
            continue
        if method != allowed:
            raise RouterError(
                405, f"{path} takes {allowed}, not {method}", code="method_not_allowed"
            )
        return path
    raise RouterError(404, f"no route for {raw_path}", code="not_found")


def forwarded_headers(headers: Mapping[str, str]) -> bytes:
    """The request head lines the catch-all sends an engine: the listed headers only."""
    lines = [f"{name}: {headers[name]}\r\n" for name in FORWARDED_HEADERS if name in headers]
    return "".join(lines).encode("latin-1")
