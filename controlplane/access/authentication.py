from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from controlplane.access.models import MachineCredential, hash_token
from controlplane.access.principal import MachinePrincipal

# last_used_at is informative; writing it on every request would double the write load.
_LAST_USED_RESOLUTION = timedelta(seconds=60)


class MachineTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer sxa_…`` (agents) or ``Bearer sxr_…`` (routers)."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[MachinePrincipal, MachineCredential] | None:
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if not header or header[0] != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Bearer header must be 'Bearer <token>'")
        token = header[1]
        if not token.startswith(("sxa_", "sxr_")):
            raise exceptions.AuthenticationFailed("not a machine token")
        try:
            credential = MachineCredential.objects.get(key_hash=hash_token(token))
        except MachineCredential.DoesNotExist:
            raise exceptions.AuthenticationFailed("unknown machine token") from None
        if not credential.active:
            raise exceptions.AuthenticationFailed("machine token revoked")
        now = timezone.now()
        if credential.last_used_at is None or now - credential.last_used_at > _LAST_USED_RESOLUTION:
            MachineCredential.objects.filter(pk=credential.pk).update(last_used_at=now)
        return MachinePrincipal(credential), credential

    def authenticate_header(self, request: Request) -> str:
        return self.keyword
