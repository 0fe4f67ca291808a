"""How an agent gets its commands: it fetches them over the authenticated HTTP API.

The :class:`AgentCommand` row is the only copy of a command. An agent asks for its own node's
queued commands (``GET agent/commands``) and, when there are none, the request waits up to
``AGENT_COMMAND_WAIT_SECONDS`` for one (a long poll). No broker URL or queue ever reaches an
agent, so an agent token reaches nothing but its own node's rows, and a revoked token is
refused on the agent's next request (docs/decisions/0019-agents-fetch-commands-over-api.md).

Waking a waiting request: with Redis configured, dispatching a command pushes a token on a
per-node list that the waiting request blocks on (``BLPOP``); the embedded defaults have no
shared process to signal through, so a waiting request re-reads the database twice a second.
Either way the database decides what is delivered: a lost or stale wake-up costs one query.

Each agent process names itself with a session id. A command is handed to a session once;
it is handed out again to a new session (the agent restarted: the agent's dispatch ledger and
its adopt-by-label start make that harmless) or after the workflow's
``expire_stale_commands`` gave up waiting for its result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.deployments.choices import CommandStatus
from controlplane.deployments.models import AgentCommand

log = logging.getLogger(__name__)

MAX_COMMANDS_PER_FETCH = 10
_DB_POLL_SECONDS = 0.5
_WAKE_TTL_SECONDS = 120
_redis_clients: dict[bool, Any] = {}


def _redis(*, blocking: bool = False) -> Any:
    """A Redis client when REDIS_URL is set, else None (one per kind, per process). Calls give
    up after a second (the blocking one: after its longest BLPOP), so a frozen Redis costs a
    fetch one slice and a dispatch one second, never a hung thread."""
    url = getattr(settings, "REDIS_URL", "")
    if not url:
        return None
    if blocking not in _redis_clients:
        import redis

        _redis_clients[blocking] = redis.Redis.from_url(
            url, socket_timeout=8.0 if blocking else 1.0, socket_connect_timeout=1.0
        )
    return _redis_clients[blocking]


def _wake_key(node_id: int) -> str:
    return f"syshax:agent-wake:{node_id}"


def wake(node_id: int) -> None:
    """Tell a waiting fetch of ``node_id``'s agent to look again. Best effort: the agent's
    next fetch finds the command in any case."""
    client = _redis()
    if client is None:
        return
    try:
        pipe = client.pipeline()
        # Two tokens: a fetch of an agent that died mid-wait may still be blocked and take one
        # (its reply goes nowhere); the restarted agent's fetch takes the other at once. A
        # spare token only costs the next fetch one query.
        pipe.rpush(_wake_key(node_id), "1", "1")
        pipe.ltrim(_wake_key(node_id), -8, -1)
        pipe.expire(_wake_key(node_id), _WAKE_TTL_SECONDS)
        pipe.execute()
    except Exception as exc:  # Redis down: the agent's own polling still finds the command
        log.warning("cannot wake the agent of node %s: %s", node_id, exc)


def _block(node_id: int, seconds: float) -> None:
    client = _redis(blocking=True)
    if client is not None:
        try:
            # BLPOP takes whole seconds on old servers; 1 s slices keep the deadline honest.
            client.blpop([_wake_key(node_id)], timeout=max(1, min(int(seconds), 5)))
            return
        except Exception as exc:
            log.warning("agent wake-up list unavailable (%s); polling the database", exc)
    time.sleep(min(seconds, _DB_POLL_SECONDS))


def take(node_id: int, session: str, limit: int = MAX_COMMANDS_PER_FETCH) -> list[AgentCommand]:
    """The node's queued commands not yet handed to ``session``, oldest first, marked as
    handed to it."""
    waiting = AgentCommand.objects.filter(node_id=node_id, status=CommandStatus.QUEUED).exclude(
        delivered_to=session
    )
    # Nearly every fetch finds nothing: one plain read answers it, without the transaction
    # and the row locks a hand-out needs.
    if not waiting.exists():
        return []
    with transaction.atomic():
        pending = list(waiting.select_for_update(skip_locked=True).order_by("created_at")[:limit])
        if pending:
            now = timezone.now()
            AgentCommand.objects.filter(pk__in=[c.pk for c in pending]).update(
                delivered_to=session, delivered_at=now, attempts=F("attempts") + 1
            )
            for command in pending:
                command.delivered_to, command.delivered_at = session, now
                command.attempts += 1
    return pending


def queued_sessions() -> dict[int, set[str]]:
    """For every node with a queued command, the sessions its queued commands were last handed
    to ("" for none yet). A fetch by a session finds something exactly when its node has a
    queued command not handed to that session: one read answers that for the whole fleet,
    which is how the machine gateway answers empty fetches without a query each."""
    queued: dict[int, set[str]] = {}
    rows = (
        AgentCommand.objects.filter(status=CommandStatus.QUEUED)
        .order_by()
        .values_list("node_id", "delivered_to")
        .distinct()
    )
    for node_id, session in rows:
        queued.setdefault(node_id, set()).add(session or "")
    return queued


def fetch(
    node_id: int,
    session: str,
    wait_seconds: float,
    still_authorized: Callable[[], bool] = lambda: True,
) -> list[AgentCommand]:
    """:func:`take`, waiting up to ``wait_seconds`` for a command when there is none.
    ``still_authorized`` is asked again after each wait, so a token revoked while its request
    waits is handed nothing."""
    deadline = time.monotonic() + max(0.0, wait_seconds)
    waited = False
    while True:
        if waited and not still_authorized():
            return []
        commands = take(node_id, session)
        remaining = deadline - time.monotonic()
        if commands or remaining <= 0:
            return commands
        _block(node_id, remaining)
        waited = True


def as_message(command: AgentCommand, node_name: str) -> dict[str, Any]:
    """What the agent executes: the fields of the row, nothing else (``traceparent`` only
    when the command was issued with tracing on)."""
    message = {
        "dispatch_id": str(command.dispatch_id),
        "node": node_name,
        "action": command.action,
        "deployment_id": command.deployment_id,
        "generation": command.generation,
        "role": command.role or None,
        "spec": command.spec,
        "attempt": command.attempts,
        "created_at": command.created_at.isoformat(),
    }
    if command.traceparent:
        message["traceparent"] = command.traceparent
    return message
