"""`syshax up`'s secrets: the admin's API token, the router's API key and the machine tokens
share var/up/tokens.json (mode 0600); each is made once and made again only when it no
longer works."""

from __future__ import annotations

import json
import stat

from controlplane.access.models import PersonalToken, hash_token
from syshax.commands import up_stack


def test_the_admin_token_is_kept_and_reissued_once_revoked(db, tmp_path) -> None:
    up_stack.ensure_admin()
    key = up_stack.admin_api_token(tmp_path)
    store = tmp_path / "up" / "tokens.json"
    assert stat.S_IMODE(store.stat().st_mode) == 0o600
    assert json.loads(store.read_text())["admin_api"] == key
    assert up_stack.admin_api_token(tmp_path) == key
    token = PersonalToken.objects.get(key_hash=hash_token(key))
    assert token.user.username == "admin"
    token.revoke()
    again = up_stack.admin_api_token(tmp_path)
    assert again != key and PersonalToken.objects.get(key_hash=hash_token(again)).active


def test_the_router_key_is_made_once_beside_the_machine_tokens(db, tmp_path) -> None:
    key, new = up_stack.ensure_router_api_key(tmp_path)
    assert new and key.startswith(up_stack.ROUTER_API_KEY_PREFIX) and len(key) > 40
    tokens = up_stack.ensure_tokens(tmp_path, "node-t")
    assert tokens["router_api_key"] == key
    assert up_stack.ensure_router_api_key(tmp_path) == (key, False)
    stored = json.loads((tmp_path / "up" / "tokens.json").read_text())
    assert set(stored) == {"agent", "router", "router_api_key"}


def test_the_router_benchmark_key_is_made_once_and_is_not_the_api_key(db, tmp_path) -> None:
    """Only the benchmark key may force a policy mode: `syshax up` keeps it apart."""
    key, _ = up_stack.ensure_router_api_key(tmp_path)
    bench = up_stack.ensure_router_benchmark_key(tmp_path)
    assert bench.startswith(up_stack.ROUTER_API_KEY_PREFIX) and bench != key
    assert up_stack.ensure_router_benchmark_key(tmp_path) == bench
    stored = json.loads((tmp_path / "up" / "tokens.json").read_text())
    assert (stored["router_api_key"], stored["router_benchmark_key"]) == (key, bench)
