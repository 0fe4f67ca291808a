"""``syshax manage issue_token USER [--name N] [--expires-days D]``: a person's API token.

The token goes to stdout alone (``TOKEN=$(syshax manage issue_token admin)``); it is shown
only now, and the database keeps its hash.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from controlplane.access.models import PersonalToken


class Command(BaseCommand):
    help = "Issue an API token for USER and print it once (only its hash is stored)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="cli", help="what the token is for (default cli)")
        parser.add_argument(
            "--expires-days", type=int, help="valid for this many days (default: until revoked)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        users = get_user_model()
        try:
            user = users._default_manager.get_by_natural_key(options["username"])
        except users.DoesNotExist:
            raise CommandError(f"no user {options['username']!r}") from None
        days = options["expires_days"]
        if days is not None and days < 1:
            raise CommandError("--expires-days must be at least 1")
        expires_at = timezone.now() + timedelta(days=days) if days else None
        token, key = PersonalToken.issue(
            user, options["name"], expires_at=expires_at, acting_user="syshax manage issue_token"
        )
        self.stderr.write(f"issued {token} for {user}; copy it now, it is not shown again")
        self.stdout.write(key)
