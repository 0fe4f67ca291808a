"""Where a node's engines are reached: the one check of a node's address and the one builder
of an engine's URL from it.

An agent reports its node's ``address`` and routers, benchmarks and the agent's own health
probes then send traffic to ``http://<address>:<port>``. Free text there lets an agent aim
that traffic anywhere (``10.0.0.5:22#`` makes ``http://10.0.0.5:22#:7001``), so an address
is a host name of RFC 1123 labels or an IP literal, and nothing else.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

MAX_HOST_NAME = 253  # RFC 1035: 255 octets on the wire, 253 characters written out
LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
# A last label that some resolver reads as a number: getaddrinfo takes "127.1", "2130706433"
# and "0x7f000001" for 127.0.0.1 (inet_aton's forms), so such a "name" is an address in
# disguise, and one the IP check below never saw.
NUMBER = re.compile(r"^(0[xX][0-9A-Fa-f]*|[0-9]+)$")

ADDRESS_RULE = (
    "must be a host name (letters, digits and '-' in dot-separated labels of 1-63 characters, "
    "at most 253 in all) or an IPv4 or IPv6 address, with no port, scheme or path"
)


class HostError(ValueError):
    """Not a host name or IP literal; the message says what is allowed."""


def _ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return None
    # A zone ("fe80::1%eth0") names an interface of the machine that wrote it, no other's.
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        return None
    return ip


def check_host(value: str) -> str:
    """``value`` unchanged when it is a host name or an IP literal (IPv6 without brackets);
    raises ``HostError`` otherwise."""
    if not isinstance(value, str):
        raise HostError(f"{ADDRESS_RULE}, got {value!r}")
    if _ip(value) is not None:
        return value
    labels = value.split(".")
    if (
        len(value) > MAX_HOST_NAME
        or not all(LABEL.match(label) for label in labels)
        or NUMBER.match(labels[-1])
    ):
        raise HostError(f"{ADDRESS_RULE}, got {value!r}")
    return value


def is_host(value: str) -> bool:
    try:
        check_host(value)
    except HostError:
        return False
    return True


def url_host(host: str) -> str:
    """``host`` as the host part of a URL: an IPv6 literal in brackets. Raises ``HostError``
    for anything ``check_host`` refuses."""
    check_host(host)
    return f"[{host}]" if ":" in host else host


def http_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` of an engine listening on ``host`` (checked, IPv6 bracketed)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise HostError(f"port must be 1-65535, got {port!r}")
    return f"http://{url_host(host)}:{port}"


def is_http_url(url: str) -> bool:
    """Whether ``url`` is exactly what ``http_url`` builds for some host and port: an
    endpoint stored before addresses were checked (``http://10.0.0.5:22#:7001``) is not."""
    if not isinstance(url, str) or not url.startswith("http://"):
        return False
    host, sep, port = url[len("http://") :].rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return http_url(host, int(port)) == url
    except HostError:
        return False


ORIGIN_RULE = (
    "must be an http:// or https:// URL of a host name or IP address with an optional port, "
    "and nothing after it (no path, query, fragment or user)"
)


def check_origin(url: str) -> str:
    """``url`` as a plain origin, ``scheme://host:port`` with the scheme and host in lower
    case, the port written out and no trailing slash; raises ``HostError`` for anything else
    (a path, a query, credentials, a host ``check_host`` refuses)."""
    if not isinstance(url, str) or any(c in url for c in "#?@\\ \t"):
        raise HostError(f"{ORIGIN_RULE}, got {url!r}")
    try:
        parts = urlsplit(url.strip().rstrip("/"))
        port = parts.port
    except ValueError:
        raise HostError(f"{ORIGIN_RULE}, got {url!r}") from None
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if (
        scheme not in ("http", "https")
        or not host
        or parts.path
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
        or not is_host(host)
    ):
        raise HostError(f"{ORIGIN_RULE}, got {url!r}")
    if port is None:
        port = 443 if scheme == "https" else 80
    if port == 0:
        raise HostError(f"{ORIGIN_RULE}, got {url!r}")
    return f"{scheme}://{url_host(host)}:{port}"
