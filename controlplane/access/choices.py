from django.db import models


class CredentialKind(models.TextChoices):
    AGENT = "agent", "node agent"
    ROUTER = "router", "router"


class AccessAuditAction(models.TextChoices):
    """The audit rows' actions on credentials and personal tokens (``AuditEntry.action``)."""

    CREDENTIAL_ISSUED = "credential.issued"
    CREDENTIAL_REVOKED = "credential.revoked"
    TOKEN_ISSUED = "token.issued"
    TOKEN_REVOKED = "token.revoked"
