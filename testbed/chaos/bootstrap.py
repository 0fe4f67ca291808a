"""``python -m testbed.chaos.bootstrap``: migrate the chaos stack's own database, create its
admin and print a person's API token for it as JSON. The only use of the ORM in the chaos
suite; everything after this goes through the REST API, as an operator's automation would."""

from __future__ import annotations

import json
import sys

from syshax.commands._django import setup


def api_token(user: object) -> str:
    """A person's API token for ``user``, sent as ``Authorization: Token <key>``."""
    try:
        # lazy: the models load once main() has set Django up
        from controlplane.access.models import PersonalToken
    except ImportError:  # a tree from before personal tokens: DRF's authtoken
        from rest_framework.authtoken.models import Token

        return str(Token.objects.get_or_create(user=user)[0].key)
    return PersonalToken.issue(user, "chaos suite")[1]


def main() -> int:
    setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    users = get_user_model()
    admin = users.objects.filter(username="chaos").first() or users.objects.create_superuser(
        "chaos", "chaos@localhost", None
    )
    json.dump({"token": api_token(admin)}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
