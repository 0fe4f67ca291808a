"""What the gateway's proxy sends the control plane: to which URL, and which fields.

The gateway serves one site and hands what it does not answer to one upstream, ``syshax
web``. Only an origin-form target reaches here (``edge.EdgeProtocol`` refuses the rest), and
the URL is built from parts: the upstream's scheme, host and port, the request's path and
query. A target such as ``x@host:port`` once named the user, host and port of the request
the gateway made, when the URL was the upstream's text followed by the target's.
"""

from __future__ import annotations

from yarl import URL

from controlplane.gateway.edge import Request

# Fields of one connection, not of the message (RFC 9110 7.6.1), never passed on; nor are
# those a message's own Connection field names. Content-Length is set for the body sent.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "expect",  # answered here (100 Continue); the body goes on whole
    }
)
# What an answer passed on leaves out of the control plane's fields: the server dates its own.
KEPT_WITHOUT = HOP_BY_HOP | {"date"}


def upstream_base(upstream: str) -> URL:
    """The upstream's URL, checked: http or https, a host, no query or fragment."""
    url = URL(upstream)
    if url.scheme not in ("http", "https") or not url.raw_host:
        raise ValueError(f"the upstream {upstream!r} is not an http:// or https:// URL")
    if url.raw_query_string or url.raw_fragment or url.raw_user:
        raise ValueError(f"the upstream {upstream!r} has a user, a query or a fragment")
    return url


def upstream_url(upstream: URL, request: Request) -> URL:
    """The control plane's URL for ``request``: the upstream's scheme, host and port, and the
    request's path (percent-encoded as sent) and query. Nothing in the target can name
    another host, port or user."""
    return URL.build(
        scheme=upstream.scheme,
        host=upstream.raw_host or "",
        port=upstream.explicit_port,
        path=upstream.raw_path.rstrip("/") + request.path,
        query_string=request.query_string,
        encoded=True,
    )


def end_to_end(
    fields: list[tuple[str, str]], dropped: frozenset[str] = HOP_BY_HOP
) -> list[tuple[str, str]]:
    """A message's fields less its hop-by-hop ones: ``dropped``, and any its ``Connection``
    field names."""
    named = {
        token.strip().lower()
        for name, value in fields
        if name.lower() == "connection"
        for token in value.split(",")
    }
    return [(k, v) for k, v in fields if (key := k.lower()) not in dropped and key not in named]
