"""The agent's Celery consumer: one queue per node, one task, no Django.

The control plane sends ``syshax.agent.command`` to ``node.<name>``. Acks are late and a lost
worker rejects (requeues) the message, so a command in flight when the agent dies is delivered
again; :class:`agents.commands.CommandExecutor` makes that redelivery harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery

import syshax.broker  # noqa: F401 - the embedded broker's syshaxfs:// scheme

TASK_NAME = "syshax.agent.command"
log = logging.getLogger("syshax.agent")


def make_app(
    *,
    broker_url: str,
    queue: str,
    handler: Callable[..., Any],
    transport_options: Mapping[str, Any] | None = None,
) -> Celery:
    app = Celery("syshax-agent", broker=broker_url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=queue,
        broker_transport_options=dict(transport_options or {}),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # the broker may be down longer than we are
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        worker_enable_remote_control=False,  # no pidbox: nobody broadcasts to agents
        accept_content=["json"],
    )

    @app.task(name=TASK_NAME, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def command(**kwargs: Any) -> None:
        handler(**kwargs)

    return app


def run_worker(app: Celery, *, queue: str, hostname: str) -> None:
    """Consume ``queue`` in this thread until the worker is told to stop (SIGTERM/SIGINT)."""
    worker = app.Worker(
        queues=[queue],
        pool="solo",
        concurrency=1,
        hostname=hostname,
        loglevel="INFO",
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        quiet=True,
    )
    worker.start()
