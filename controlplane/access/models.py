from __future__ import annotations

import hashlib
import secrets
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from controlplane.access.choices import AccessAuditAction, CredentialKind
from controlplane.core import audit
from controlplane.core.actors import Actor

TOKEN_PREFIX = {CredentialKind.AGENT: "sxa_", CredentialKind.ROUTER: "sxr_"}
PERSONAL_TOKEN_PREFIX = "sxp_"
# Shown in lists so a person can tell their tokens apart: the prefix and four random characters.
KEY_HINT_LENGTH = 8


def _revoke_once(
    token: MachineCredential | PersonalToken, action: AccessAuditAction, acting_user: Actor
) -> bool:
    """Set ``revoked_at`` unless it is set (a compare-and-set) and audit it; True if it was
    revoked now."""
    now = timezone.now()
    with transaction.atomic():
        changed = (
            type(token).objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now)
        )
        if changed:
            token.revoked_at = now
            audit.record(action, token, acting_user=acting_user)
    return bool(changed)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# A credential's fields whose change is no new revision: its use, noted as it is used.
USE_FIELDS = frozenset({"last_used_at"})


class MachineCredentialQuerySet(models.QuerySet["MachineCredential"]):
    def update(self, **kwargs: Any) -> int:
        """Any change but a use is a new revision (``MachineCredential.revision``)."""
        if set(kwargs) - USE_FIELDS:
            kwargs.setdefault("revision", models.F("revision") + 1)
        return super().update(**kwargs)


class MachineCredential(models.Model):
    """A scoped bearer token for an agent (bound to one node) or a router.

    Only the SHA-256 of the token is stored; the token itself is shown once when issued.
    """

    kind = models.CharField(max_length=8, choices=CredentialKind.choices)
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    key_hint = models.CharField(max_length=12, editable=False, help_text="first characters")
    node = models.ForeignKey(
        # By name: the inventory app sits above this one (docs/architecture.md).
        "inventory.Node",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="credentials",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Counts the credential's changes (all but its use), whatever the ORM path: save(), a
    # queryset's update(). The machine gateway's cache of lookups watches their sum
    # (credentials_fingerprint), so a credential moved to another node or kind is dropped.
    revision = models.PositiveBigIntegerField(default=0, editable=False)

    objects = MachineCredentialQuerySet.as_manager()

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

    def save(self, *args: Any, **kwargs: Any) -> None:
        fields = kwargs.get("update_fields")
        if self._state.adding or (fields is not None and not set(fields) - USE_FIELDS):
            super().save(*args, **kwargs)
            return
        revision = self.revision
        self.revision = models.F("revision") + 1  # type: ignore[assignment]
        if fields is not None:
            kwargs["update_fields"] = {*fields, "revision"}
        try:
            super().save(*args, **kwargs)
        except BaseException:
            self.revision = revision
            raise
        self.refresh_from_db(fields=["revision"])

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @classmethod
    def issue(
        cls, kind: str, name: str, *, node: models.Model | None = None, created_by: Actor = None
    ) -> tuple[MachineCredential, str]:
        """Create a credential and return it with its plaintext token (shown only now).

        ``node`` is an ``inventory.Node`` (typed as a model: the access app sits below the
        inventory in the layers and names it only in its foreign key)."""
        token = TOKEN_PREFIX[CredentialKind(kind)] + secrets.token_urlsafe(32)
        user, _ = audit.split_actor(created_by)
        with transaction.atomic():
            credential = cls.objects.create(
                kind=kind,
                name=name,
                node=node,
                key_hash=hash_token(token),
                key_hint=token[:KEY_HINT_LENGTH],
                created_by=user,
            )
            detail = {"kind": kind, "name": name, "node": str(node) if node else None}
            audit.record(
                AccessAuditAction.CREDENTIAL_ISSUED,
                credential,
                acting_user=created_by,
                detail=detail,
            )
        return credential, token

    def revoke(self, *, acting_user: Actor = None) -> bool:
        """Revoke the credential; False if it already was (nothing recorded then)."""
        return _revoke_once(self, AccessAuditAction.CREDENTIAL_REVOKED, acting_user)


class PersonalToken(models.Model):
    """A person's API token (``sxp_…``), sent as ``Authorization: Token <key>`` or ``Bearer``.

    Only the SHA-256 of the token is stored; the token itself is shown once when issued.
    Tokens carried over from DRF's authtoken keep their old 40-hex-digit key.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    key_hint = models.CharField(max_length=12, editable=False, help_text="first characters")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="empty: never")
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["user", "name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.key_hint}…)"

    @property
    def active(self) -> bool:
        return self.revoked_at is None and not self.expired

    @property
    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @classmethod
    def issue(
        cls,
        user: Any,
        name: str,
        *,
        expires_at: datetime | None = None,
        acting_user: Actor = None,
    ) -> tuple[PersonalToken, str]:
        """Create a token for ``user`` and return it with its plaintext (shown only now)."""
        key = PERSONAL_TOKEN_PREFIX + secrets.token_urlsafe(32)
        with transaction.atomic():
            token = cls.objects.create(
                user=user,
                name=name,
                key_hash=hash_token(key),
                key_hint=key[:KEY_HINT_LENGTH],
                expires_at=expires_at,
            )
            audit.record(
                AccessAuditAction.TOKEN_ISSUED,
                token,
                acting_user=acting_user,
                detail={"user": user.get_username()},
            )
        return token, key

    def revoke(self, *, acting_user: Actor = None) -> bool:
        """Revoke the token; False if it already was (nothing recorded then)."""
        return _revoke_once(self, AccessAuditAction.TOKEN_REVOKED, acting_user)
