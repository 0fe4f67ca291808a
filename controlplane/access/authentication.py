from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from controlplane.access.models import (
    PERSONAL_TOKEN_PREFIX,
    MachineCredential,
    PersonalToken,
    hash_token,
)
from controlplane.access.principal import MachinePrincipal


def note_use(model: type[models.Model], pk: Any, last_used_at: Any) -> None:
    # last_used_at is informative: written at most once per TOKEN_LAST_USED_SECONDS a token.
    # Every request would double the write load; even once a minute, 5,000 agents would add
    # 80 writes a second to their 500 heartbeats
    # (docs/decisions/0024-heartbeat-seven-statements.md).
    now = timezone.now()
    resolution = timedelta(seconds=settings.TOKEN_LAST_USED_SECONDS)
    if last_used_at is None or now - last_used_at > resolution:
        model._default_manager.filter(pk=pk).update(last_used_at=now)


def active_machine_credentials(tokens: Iterable[str]) -> dict[str, MachineCredential]:
    """The active credentials of machine tokens (``sxa_``/``sxr_``), by token, their use
    noted; unknown, revoked and other tokens are left out. The machine gateway's lookup, one
    query for many tokens; :class:`MachineTokenAuthentication` is the one that explains a
    refusal."""
    by_hash = {hash_token(t): t for t in tokens if t.startswith(("sxa_", "sxr_"))}
    if not by_hash:
        return {}
    found = {
        by_hash[c.key_hash]: c
        for c in MachineCredential.objects.filter(
            key_hash__in=by_hash, revoked_at__isnull=True
        ).only("pk", "kind", "node_id", "key_hash", "last_used_at")
    }
    now = timezone.now()
    resolution = timedelta(seconds=settings.TOKEN_LAST_USED_SECONDS)
    stale = [
        c.pk for c in found.values() if c.last_used_at is None or now - c.last_used_at > resolution
    ]
    if stale:
        MachineCredential.objects.filter(pk__in=stale).update(last_used_at=now)
    return found


def credentials_fingerprint() -> tuple[Any, ...]:
    """Changes whenever a machine credential is issued, changed in any way but its use (its
    kind, node, revocation: ``MachineCredential.revision``) or deleted: the gateway drops its
    cached lookups when it does. Issuing raises the largest id (ids are never reused),
    deleting lowers the count, and any other change raises the sum of revisions."""
    totals = MachineCredential.objects.aggregate(
        n=models.Count("pk"),
        top=models.Max("pk"),
        ids=models.Sum("pk"),
        revisions=models.Sum("revision"),
        revoked=models.Count("revoked_at"),
        last=models.Max("revoked_at"),
    )
    return tuple(totals[k] for k in ("n", "top", "ids", "revisions", "revoked", "last"))


def _authorization(request: Request) -> list[str]:
    return authentication.get_authorization_header(request).decode("latin-1").split()


class MachineTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer sxa_…`` (agents) or ``Bearer sxr_…`` (routers)."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[MachinePrincipal, MachineCredential] | None:
        header = _authorization(request)
        if not header or header[0] != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Bearer header must be 'Bearer <token>'")
        token = header[1]
        if token.startswith(PERSONAL_TOKEN_PREFIX):
            return None  # a person's token: PersonalTokenAuthentication
        if not token.startswith(("sxa_", "sxr_")):
            raise exceptions.AuthenticationFailed("not a machine token")
        try:
            credential = MachineCredential.objects.get(key_hash=hash_token(token))
        except MachineCredential.DoesNotExist:
            raise exceptions.AuthenticationFailed("unknown machine token") from None
        if not credential.active:
            raise exceptions.AuthenticationFailed("machine token revoked")
        note_use(MachineCredential, credential.pk, credential.last_used_at)
        return MachinePrincipal(credential), credential

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class PersonalTokenAuthentication(authentication.BaseAuthentication):
    """A person's API token: ``Authorization: Token <key>`` (DRF's keyword, so clients of its
    authtoken keep working, old keys included) or ``Authorization: Bearer sxp_…``."""

    keyword = "Token"

    def authenticate(self, request: Request) -> tuple[Any, PersonalToken] | None:
        header = _authorization(request)
        if not header:
            return None
        scheme = header[0]
        bearer = scheme == "Bearer" and len(header) == 2
        if bearer and not header[1].startswith(PERSONAL_TOKEN_PREFIX):
            return None
        if not bearer and scheme.lower() != self.keyword.lower():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Token header must be 'Token <key>'")
        try:
            token = PersonalToken.objects.select_related("user").get(key_hash=hash_token(header[1]))
        except PersonalToken.DoesNotExist:
            raise exceptions.AuthenticationFailed("unknown token") from None
        if token.revoked_at is not None:
            raise exceptions.AuthenticationFailed("token revoked")
        if token.expired:
            raise exceptions.AuthenticationFailed("token expired")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("user inactive")
        note_use(PersonalToken, token.pk, token.last_used_at)
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return self.keyword
