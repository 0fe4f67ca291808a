"""People's API tokens: only a hash is stored, the token is shown once, DRF's old keys keep
working after the migration, and a revoked, expired or unknown token is a 401."""

from __future__ import annotations

import hashlib
import importlib
import io
import re
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.access.models import PersonalToken
from controlplane.core.models import AuditEntry

migration = importlib.import_module("controlplane.access.migrations.0002_personal_tokens")
TOKEN = re.compile(r"sxp_[A-Za-z0-9_-]{43}")


def api(authorization: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=authorization)
    return client


def test_a_stored_row_never_holds_the_plaintext(admin_user) -> None:
    token, key = PersonalToken.issue(admin_user, "laptop")
    assert TOKEN.fullmatch(key)
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM access_personaltoken WHERE id = %s", [token.pk])
        row = cursor.fetchone()
    assert not any(key in str(value) for value in row)
    assert token.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert token.key_hint == key[:8] and str(token) == f"laptop ({key[:8]}…)"
    assert AuditEntry.objects.filter(action="token.issued", object_id=str(token.pk)).exists()


@pytest.mark.parametrize("keyword", ["Token", "token", "Bearer"])
def test_a_token_authenticates_with_drfs_keyword_or_as_a_bearer(admin_user, keyword) -> None:
    token, key = PersonalToken.issue(admin_user, "laptop")
    assert api(f"{keyword} {key}").get("/api/v1/nodes/").status_code == 200
    token.refresh_from_db()
    assert token.last_used_at is not None
    used = token.last_used_at
    api(f"{keyword} {key}").get("/api/v1/nodes/")
    token.refresh_from_db()
    assert token.last_used_at == used  # written at most once a minute


def test_a_revoked_expired_or_unknown_token_is_401(admin_user) -> None:
    revoked, revoked_key = PersonalToken.issue(admin_user, "old")
    assert revoked.revoke(acting_user=admin_user) and not revoked.revoke()
    expired_key = PersonalToken.issue(
        admin_user, "short", expires_at=timezone.now() - timedelta(seconds=1)
    )[1]
    cases = {
        f"Token {revoked_key}": "token revoked",
        f"Bearer {revoked_key}": "token revoked",
        f"Token {expired_key}": "token expired",
        "Token 0123456789abcdef0123456789abcdef01234567": "unknown token",
        "Bearer sxp_not-a-real-token": "unknown token",
        "Token": "Token header must be 'Token <key>'",
    }
    for authorization, message in cases.items():
        response = api(authorization).get("/api/v1/nodes/")
        assert response.status_code == 401, authorization
        assert response.json()["error"]["message"] == message, authorization
    assert AuditEntry.objects.filter(action="token.revoked").count() == 1


def test_an_inactive_persons_token_is_401(admin_user) -> None:
    key = PersonalToken.issue(admin_user, "laptop")[1]
    User.objects.filter(pk=admin_user.pk).update(is_active=False)
    response = api(f"Token {key}").get("/api/v1/nodes/")
    assert response.status_code == 401
    assert response.json()["error"]["message"] == "user inactive"


def test_an_old_authtoken_key_works_after_the_conversion(admin_user) -> None:
    old_key = "9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b"  # DRF's format: 40 hex digits
    rows = [(old_key, admin_user.pk, "2024-01-02 03:04:05")]
    assert migration.convert_legacy_keys(PersonalToken, rows) == 1
    assert migration.convert_legacy_keys(PersonalToken, rows) == 0  # converted once
    token = PersonalToken.objects.get(user=admin_user)
    assert token.key_hash == hashlib.sha256(old_key.encode()).hexdigest()
    assert (token.key_hint, token.name) == ("9944b091", migration.LEGACY_NAME)
    assert token.created_at.year == 2024
    assert api(f"Token {old_key}").get("/api/v1/nodes/").status_code == 200


def test_the_migration_carries_over_an_authtoken_table_and_empties_it(admin_user) -> None:
    old_key = "a" * 40
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamp "
            "NOT NULL, user_id integer NOT NULL)"
        )
        cursor.execute(
            "INSERT INTO authtoken_token VALUES (%s, %s, %s)",
            [old_key, "2023-05-06 07:08:09", admin_user.pk],
        )
        migration.carry_over_authtoken_keys(apps, SimpleNamespace(connection=connection))
        cursor.execute("SELECT COUNT(*) FROM authtoken_token")
        assert cursor.fetchone()[0] == 0  # no plaintext key is left behind
        cursor.execute("DROP TABLE authtoken_token")
    assert api(f"Token {old_key}").get("/api/v1/nodes/").status_code == 200
    # A database that never had DRF's authtoken has nothing to convert.
    migration.carry_over_authtoken_keys(apps, SimpleNamespace(connection=connection))
    assert PersonalToken.objects.count() == 1


def test_the_admin_shows_the_token_once_and_then_only_its_hint(admin_user) -> None:
    browser = Client()
    browser.force_login(admin_user)
    added = browser.post(
        reverse("admin:access_personaltoken_add"),
        {"user": admin_user.pk, "name": "laptop"},
        follow=True,
    )
    assert added.status_code == 200
    shown = TOKEN.findall(added.content.decode())
    assert len(shown) == 1, "the new token is shown once, in the message"
    key = shown[0]
    token = PersonalToken.objects.get(name="laptop")
    assert token.key_hash == hashlib.sha256(key.encode()).hexdigest()
    pages = [
        reverse("admin:access_personaltoken_changelist"),
        reverse("admin:access_personaltoken_change", args=[token.pk]),
    ]
    for url in pages:
        page = browser.get(url).content.decode()
        assert key[:8] in page
        assert key not in page and token.key_hash not in page, url
    assert api(f"Token {key}").get("/api/v1/nodes/").status_code == 200
    browser.post(
        reverse("admin:access_personaltoken_changelist"),
        {"action": "revoke", "_selected_action": [token.pk]},
    )
    assert api(f"Token {key}").get("/api/v1/nodes/").status_code == 401


def test_in_the_admin_a_non_superuser_issues_and_sees_only_their_own_tokens(admin_user) -> None:
    staff = User.objects.create_user("staff", password="x-unused-x", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(codename__endswith="_personaltoken"))
    PersonalToken.issue(admin_user, "root's")
    browser = Client()
    browser.force_login(staff)
    url = reverse("admin:access_personaltoken_add")
    refused = browser.post(url, {"user": admin_user.pk, "name": "as root"})
    assert refused.status_code == 200 and "Select a valid choice" in refused.content.decode()
    browser.post(url, {"user": staff.pk, "name": "mine"})
    listed = browser.get(reverse("admin:access_personaltoken_changelist")).content.decode()
    assert "mine" in listed and "root&#x27;s" not in listed and "root's" not in listed
    assert PersonalToken.objects.filter(user=staff).count() == 1


def test_issue_token_prints_the_token_alone_on_stdout(admin_user) -> None:
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "issue_token", "root", "--name", "ci", "--expires-days", "30", stdout=out, stderr=err
    )
    key = out.getvalue().strip()
    assert TOKEN.fullmatch(key) and key not in err.getvalue()
    assert f"issued ci ({key[:8]}…) for root" in err.getvalue()
    token = PersonalToken.objects.get(name="ci")
    assert token.expires_at is not None and token.expires_at > timezone.now() + timedelta(days=29)
    assert api(f"Bearer {key}").get("/api/v1/nodes/").status_code == 200
    with pytest.raises(CommandError, match="no user 'nobody'"):
        call_command("issue_token", "nobody", stdout=out, stderr=err)
