from __future__ import annotations

import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

from controlplane.access.choices import CredentialKind
from controlplane.core.audit import split_actor
from controlplane.inventory.models import Node

TOKEN_PREFIX = {CredentialKind.AGENT: "sxa_", CredentialKind.ROUTER: "sxr_"}


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class MachineCredential(models.Model):
    """A scoped bearer token for an agent (bound to one node) or a router.

    Only the SHA-256 of the token is stored; the token itself is shown once when issued.
    """

    kind = models.CharField(max_length=8, choices=CredentialKind.choices)
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    key_hint = models.CharField(max_length=12, editable=False, help_text="first characters")
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.CASCADE, related_name="credentials"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["kind", "name"]
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(kind="agent", node__isnull=False))
                | (models.Q(kind="router", node__isnull=True)),
                name="credential_agent_has_node_router_has_none",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind}:{self.name} ({self.key_hint}…)"

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @classmethod
    def issue(
        cls, kind: str, name: str, *, node: Node | None = None, created_by: object = None
    ) -> tuple[MachineCredential, str]:
        """Create a credential and return it with its plaintext token (shown only now)."""
        token = TOKEN_PREFIX[CredentialKind(kind)] + secrets.token_urlsafe(32)
        user, _ = split_actor(created_by)
        credential = cls.objects.create(
            kind=kind,
            name=name,
            node=node,
            key_hash=hash_token(token),
            key_hint=token[:8],
            created_by=user,
        )
        return credential, token

    def revoke(self) -> None:
        self.revoked_at = timezone.now()
        self.save(update_fields=["revoked_at"])
