from django.db import models


class CredentialKind(models.TextChoices):
    AGENT = "agent", "node agent"
    ROUTER = "router", "router"
