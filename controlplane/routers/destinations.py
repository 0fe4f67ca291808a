"""Where the control plane sends a router key, the benchmark key or a tenant's prompts: the
routers the operator configured (``ROUTER_URLS``), and nowhere else.

A router reports its own ``listen_url`` when it registers; anyone holding a router token can
register one, so that address is shown (marked not configured) but never sent anything
(docs/decisions/0056-router-destinations-configured.md). A registered router whose address
matches a configured one only tells which configured router is alive; the request still goes
to the configured URL.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

from common.hosts import HostError, check_origin
from controlplane.routers.models import RouterInstance

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class Destination:
    """A configured router: its URL, and the registered router answering there, if any."""

    url: str
    router: RouterInstance | None = None

    @property
    def name(self) -> str:
        return self.router.name if self.router is not None else self.url

    @property
    def is_alive(self) -> bool:
        return self.router is not None and self.router.is_alive


def configured_urls() -> list[str]:
    """``ROUTER_URLS``, as checked origins (settings checked them at start)."""
    return [str(url).rstrip("/") for url in settings.ROUTER_URLS]


def _key(url: str) -> tuple[str, str, int] | None:
    """Scheme, host and port, with the loopback names as one, to match a reported address
    with a configured one; None for what is not a plain origin."""
    try:
        origin = check_origin(url)
    except HostError:
        return None
    parts = urlsplit(origin)
    host = (parts.hostname or "").lower()
    return parts.scheme, "127.0.0.1" if host in LOOPBACK else host, parts.port or 0


def is_configured(url: str) -> bool:
    """Whether ``url`` (a reported listen_url, a benchmark's target) is a configured router."""
    key = _key(url) if url else None
    return key is not None and key in {_key(u) for u in configured_urls()}


def destinations() -> list[Destination]:
    """Every configured router, in ``ROUTER_URLS`` order, each with the registered router seen
    last at its address."""
    urls = configured_urls()
    if not urls:
        return []
    by_key: dict[tuple[str, str, int], RouterInstance] = {}
    for router in RouterInstance.objects.exclude(listen_url="").order_by("last_seen_at"):
        key = _key(router.listen_url)
        if key is not None:
            by_key[key] = router  # the one seen last wins
    return [Destination(url, by_key.get(_key(url) or ("", "", 0))) for url in urls]


def pick() -> Destination | None:
    """The configured router to send to: one whose registered router is alive (the one seen
    last), else the first configured; None when none is configured."""
    found = destinations()
    alive = [(d.router.last_seen_at, i) for i, d in enumerate(found) if d.router and d.is_alive]
    if alive:
        return found[max(alive)[1]]
    return found[0] if found else None


def router_key_for(url: str) -> str:
    """The routers' benchmark key (``ROUTER_BENCHMARK_KEY``, which may force each mode; else
    ``ROUTER_API_KEY``) when ``url`` is a configured router's, else nothing: a key is never
    sent to an engine, an allowed outside target or an address a router only reported."""
    key = str(settings.ROUTER_BENCHMARK_KEY or settings.ROUTER_API_KEY)
    return key if key and is_configured(url) else ""
