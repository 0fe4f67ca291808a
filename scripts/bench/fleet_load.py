#!/usr/bin/env python3
"""Fleet scale: the real control plane on PostgreSQL under N agents, M routers and an operator.

    .venv/bin/python scripts/bench/fleet_load.py --agents 200 --routers 20 --seconds 20   # quick
    .venv/bin/python scripts/bench/fleet_load.py --agents 5000 --routers 200 --seconds 90 --lost 50
    .venv/bin/python scripts/bench/fleet_load.py --agents 5000 --reaper-only    # one reaper pass

It creates a database of its own (``syshax_fleet_<random>``) on ``--postgres``, migrates it and
issues every credential in-process (``MachineCredential.issue``: one agent token per node, one
router token per router, and a superuser's API token for the operator). Then it starts the
control plane as production runs it: ``syshax web`` (gunicorn with ``BufferedRequestWorker``)
under ``controlplane.settings.production``, and a Celery worker and beat on the Redis
database ``--redis`` (flushed before and after). Over HTTP, from one asyncio process with at
most ``--connections`` connections, start times spread uniformly over the period:

- each agent PUTs its inventory once (this machine's CPU topology and 8 simulated A100s,
  as ``agents.discovery`` builds them), then POSTs a heartbeat as ``collect_heartbeat`` does,
  waiting ``--period`` seconds from each answer, jittered as the agent jitters it
  (``agents.client.jittered``), and fetches its commands with ``wait=0`` (a real agent holds a
  long poll open instead: 5,000 of them would hold 5,000 web threads, see docs/scale.md;
  with ``--gateway --long-poll 20`` each agent holds one, as the real agent does);
  the agent of the first node answers its commands, so a deployment really comes up;
- each router registers, then every ``--router-interval`` seconds GETs
  ``routing/policies/default`` and ``routing/deployments`` with ``If-None-Match`` and POSTs
  stats every ``--stats-interval`` seconds;
- the operator creates a profile and a deployment on the first node and deploys it, changes a
  policy knob, and runs a short benchmark on the deployment's GPU engine (a ``syshax sim``);
- with ``--lost K`` the agents of K nodes stop heartbeating early, and beat's reaper must
  mark them offline.

Two periods are warm-up (every inventory PUT and first heartbeat, ``--warmup``); the table
covers the ``--seconds`` after: per endpoint the count, p50/p99 latency and errors, the CPU
seconds of the control plane's processes, of this script and of everything else, and the
database's counters and backend states. After the load it counts the queries of one
heartbeat, one command fetch and both 304s in-process (Django's ``CaptureQueriesContext`` on
the loaded database) with their median CPU and wall time, and times reaper passes over all
the nodes with ``--stale`` of them silent. The database is dropped at the end (``--keep-db``
keeps it).

Two gateways side by side: ``--gateway --versus TREE --repeat 3`` runs the whole measurement
six times, alternating the gateway of another checkout (``TREE``, e.g. made by ``git archive
REV | tar -x -C TREE``; only the gateway process runs its code) with this one's, and prints
each run's figures and the medians of each side.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from common.gc_pauses import CollectionTimes, freeze_heap  # noqa: E402
from common.supervisor import free_port  # noqa: E402
from loadgen import wire  # noqa: E402
from testbed import stall_probe  # noqa: E402

HOST = "127.0.0.1"
GPUS_PER_NODE = 8
SPEC_TIMEOUT = 30.0
HELD = " (held)"  # an endpoint held open by design (a long poll): its time is not a delay
FREEZE_AHEAD = 3.0  # seconds before the measured window the load generator's heap is frozen


# ------------------------------------------------------------------ the stack


def server_env(database_url: str, redis_url: str, var_dir: Path, period: float) -> dict[str, str]:
    """The environment production needs (docs/configuration.md), and nothing from a file."""
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.production",
            "SYSHAX_ENV_FILE": str(var_dir / "none.env"),
            "SYSHAX_VAR_DIR": str(var_dir),
            "SECRET_KEY": secrets.token_urlsafe(64),
            "ALLOWED_HOSTS": "127.0.0.1,localhost,testserver",
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "SECURE_SSL_REDIRECT": "false",
            "HEARTBEAT_INTERVAL_SECONDS": str(period),
            "BENCHMARK_ALLOWED_TARGETS": HOST,
            "LOG_LEVEL": "WARNING",
        }
    )
    return env


def pg_connect(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=True)


@contextmanager
def fleet_database(postgres: str) -> Iterator[str]:
    name = f"syshax_fleet_{secrets.token_hex(4)}"
    with pg_connect(f"{postgres}/postgres") as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{postgres}/{name}"
    finally:
        if not ARGS.keep_db:
            with pg_connect(f"{postgres}/postgres") as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        else:
            print(f"kept database {name}")


def syshax(*argv: str) -> list[str]:
    return [sys.executable, "-m", "syshax.cli", *argv]


def in_django(env: dict[str, str], step: str, *extra: str) -> dict[str, Any]:
    """Run one ``--step`` of this script in a child that has Django set up; its JSON answer."""
    out = subprocess.run(
        [sys.executable, __file__, "--step", step, *extra],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode:
        raise SystemExit(f"step {step} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@dataclass
class Stack:
    env: dict[str, str]
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], cwd: Path = ROOT, **env: str) -> None:
        """Start ``argv`` in ``cwd``, whose code ``python -m`` runs before the installed one."""
        log = (self.logs / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            argv, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT, cwd=cwd
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------ recording


@dataclass
class Endpoint:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))


# The load generator's own collections over 20 ms: while one runs, every answer in flight
# waits, and is timed late.
COLLECTIONS = CollectionTimes(keep_over=0.02)
# The load generator's own event loop running late (time.time(), seconds): every answer
# that arrives meanwhile is timed that much late, which is the instrument's error.
LOOP_LATE: list[tuple[float, float]] = []


async def watch_own_loop(every: float = 0.01, over: float = 0.02) -> None:
    """Note each time this process's loop runs a timer ``over`` seconds late or more."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every
        await asyncio.sleep(every)
        late = loop.time() - due
        if late >= over:
            LOOP_LATE.append((time.time(), late))


class Recorder:
    def __init__(self) -> None:
        self.endpoints: dict[str, Endpoint] = defaultdict(Endpoint)
        self.measuring = False
        self.events: dict[str, float] = {}
        self.slow: list[tuple[float, str, float]] = []  # (when, endpoint, seconds) over 100 ms

    def note(self, name: str, seconds: float, status: int | None, error: str = "") -> None:
        if not self.measuring and name != "PUT inventory":
            return
        ep = self.endpoints[name]
        if status is not None:
            ep.statuses[status] += 1
        if error:
            ep.errors[error] += 1
        else:
            ep.latencies.append(seconds)
            if seconds > 0.1 and self.measuring and not name.endswith(HELD):
                self.slow.append((time.time() - START_WALL, name, seconds))


class Api:
    """Every call timed and recorded under its endpoint name, over one shared client: bare
    asyncio protocols (``loadgen.wire``, at most ``limit`` requests at once) or an
    aiohttp session (``--client aiohttp``, which limits its own connections)."""

    def __init__(self, base: str, recorder: Recorder, client: Any, limit: int) -> None:
        self.base = base
        self.recorder = recorder
        self.client = client
        self.limit = asyncio.Semaphore(limit)

    async def _send(
        self, method: str, url: str, body: bytes | None, head: dict[str, str], held: bool
    ) -> tuple[int, bytes, dict[str, str]]:
        if isinstance(self.client, wire.ConnectionPool):
            # A held long poll has a connection of its own, as each real agent has: it does
            # not count against the shared limit, which it would otherwise fill for 20 s.
            async with nullcontext() if held else self.limit:
                resp = await wire.request(self.client, method, url, body, head, SPEC_TIMEOUT)
            if resp.error:
                raise wire.WireError(resp.error)
            return resp.head.status, b"".join(p for _, p in resp.pieces), resp.head.headers
        async with self.client.request(method, url, data=body, headers=head) as answer:
            raw = await answer.read()
            return answer.status, raw, {k.lower(): v for k, v in answer.headers.items()}

    async def call(
        self,
        name: str,
        method: str,
        path: str,
        token: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200, 201, 202, 304),
        by_status: bool = False,
        held: bool = False,
    ) -> tuple[int | None, Any, dict[str, str]]:
        """(status, the JSON answer, the answer's headers by lower-case name)."""
        head = {"Authorization": f"Bearer {token}", **(headers or {})}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            head["Content-Type"] = "application/json"
        start = time.perf_counter()
        try:
            status, raw, answer_headers = await self._send(
                method, self.base + path, payload, head, held
            )
        except Exception as exc:  # a transport error is an error of this endpoint, not fatal
            self.recorder.note(name, time.perf_counter() - start, None, type(exc).__name__)
            return None, None, {}
        seconds = time.perf_counter() - start
        if by_status and status in (200, 304):
            name = f"{name} {status}"
        self.recorder.note(name, seconds, status, "" if status in ok else f"HTTP {status}")
        data = json.loads(raw) if raw and status != 304 else None
        return status, data, answer_headers


# ------------------------------------------------------------------ simulated machines


def base_inventory() -> dict[str, Any]:
    from agents.discovery import collect_inventory

    return collect_inventory(node_name="fleet", address=HOST)


def node_inventory(base: dict[str, Any], name: str) -> dict[str, Any]:
    from agents.discovery import simulated_accelerators

    return {
        **base,
        "hostname": name,
        "accelerators": simulated_accelerators(["a100-80gb"] * GPUS_PER_NODE, name),
    }


def heartbeat_payload(inventory: dict[str, Any], digest: str, rng: random.Random) -> dict[str, Any]:
    """What ``agents.discovery.collect_heartbeat`` sends for idle simulated cards."""
    from agents.discovery import simulated_load

    total = int(inventory["cpu"].get("memory_total_bytes") or 64 * 1024**3)
    return {
        "cpu_percent": round(rng.uniform(1, 60), 1),
        "memory_used_bytes": int(total * rng.uniform(0.1, 0.6)),
        "memory_total_bytes": total,
        "inventory_hash": digest,
        "accelerators": [simulated_load(acc, None) for acc in inventory["accelerators"]],
    }


def next_tick(tick: float, every: float, now: float) -> float:
    """The next time on the schedule still ahead: a late machine skips what it missed, as
    the real agent and router do, rather than catching up in a burst."""
    tick += every
    while tick <= now:
        tick += every
    return tick


async def agent(
    api: Api, index: int, node: dict[str, Any], base: dict[str, Any], offset: float, stop: float
) -> None:
    from agents.discovery import inventory_hash

    rng = random.Random(index)
    inventory = node_inventory(base, node["name"])
    digest = inventory_hash(inventory)
    token, node_id = node["token"], node["id"]
    session = f"fleet-{index}"
    await asyncio.sleep(offset)
    _, stored, _ = await api.call(
        "PUT inventory", "PUT", f"nodes/{node_id}/inventory", token, inventory
    )
    if stored and stored.get("changed"):
        api.recorder.events["inventories changed"] = (
            api.recorder.events.get("inventories changed", 0) + 1
        )
    lost_at = ARGS.lost_at if index >= len(NODES) - ARGS.lost else None

    async def fetch(wait: float = 0.0) -> int | None:
        """One command fetch, its commands answered; its status (None: a transport error)."""
        name = f"GET agent/commands{HELD if wait else ''}"
        path = f"agent/commands?session={session}&wait={wait:g}"
        status, body, _ = await api.call(name, "GET", path, token, held=bool(wait))
        for command in (body or {}).get("commands", []):
            await answer_command(api, token, node_id, command)
        return status

    # As the agent runs (agents/main.py): heartbeats on one thread, commands on the other.
    # With --long-poll the command side holds a fetch open, asked again once answered. Else
    # the deployment's node fetches every second, as a long poll would hand it a command at
    # once, and every other agent fetches once a heartbeat, after it.
    side = None
    if ARGS.long_poll:
        side = asyncio.create_task(commands_held(fetch, stop))
    elif index == 0:
        side = asyncio.create_task(commands_every_second(fetch, stop))
    try:
        await heartbeats(
            api, node_id, token, inventory, digest, rng, lost_at, stop, None if side else fetch
        )
    finally:
        if side is not None:
            side.cancel()
            with suppress(asyncio.CancelledError):
                await side


async def heartbeats(
    api: Api,
    node_id: int,
    token: str,
    inventory: dict[str, Any],
    digest: str,
    rng: random.Random,
    lost_at: float | None,
    stop: float,
    after: Callable[[], Awaitable[Any]] | None,
) -> None:
    """An agent's heartbeat loop, ``after`` each answer, until ``stop`` or ``lost_at``."""
    from agents.client import jittered

    loop = asyncio.get_running_loop()
    end = min(stop, lost_at) if lost_at is not None else stop
    while loop.time() < end:
        payload = heartbeat_payload(inventory, digest, rng)
        await api.call("POST heartbeat", "POST", f"nodes/{node_id}/heartbeat", token, payload)
        if after is not None:
            await after()
        # As the agent waits (agents/main.py): a jittered interval from this answer. A fixed
        # phase kept the one the first inventory answer gave, and those answers came in
        # groups, so the fleet beat in bursts every period (decision 39).
        await asyncio.sleep(max(0.0, min(end - loop.time(), jittered(ARGS.period, rng=rng))))
    if lost_at is not None and loop.time() >= lost_at:
        api.recorder.events.setdefault("lost_silent_at", time.time())  # the agent has died


# The command side ends at ``stop`` by itself too: Python 3.11's wait_for (inside the client)
# can lose a cancellation that meets a response, and the fetches then went on for ever.
async def commands_every_second(fetch: Callable[[], Awaitable[Any]], stop: float) -> None:
    loop = asyncio.get_running_loop()
    tick = loop.time()
    while loop.time() < stop:
        await fetch()
        tick = next_tick(tick, 1.0, loop.time())
        await asyncio.sleep(max(0.0, tick - loop.time()))


async def commands_held(fetch: Callable[[float], Awaitable[int | None]], stop: float) -> None:
    """Each fetch held by the control plane until a command is queued or ``--long-poll``
    ends, then asked again at once."""
    while asyncio.get_running_loop().time() < stop:
        if await fetch(ARGS.long_poll) is None:
            await asyncio.sleep(1.0)  # a transport error: the agent backs off


async def answer_command(api: Api, token: str, node_id: int, command: dict[str, Any]) -> None:
    """The first node's agent: every engine starts healthy at once, every stop succeeds."""
    containers = []
    if command["action"] == "start":
        spec = command.get("spec") or {}
        containers.append(
            {
                "deployment_id": command["deployment_id"],
                "generation": command["generation"],
                "role": command["role"],
                "engine_id": f"fleet-{command['dispatch_id'][:8]}",
                "name": f"syshax-fleet-{command['role']}",
                "status": "running",
                "health": "healthy",
                "endpoint": f"http://{HOST}:{spec.get('port', 0)}",
            }
        )
    result = {"status": "succeeded", "detail": "", "containers": containers}
    await api.call(
        "POST command result", "POST", f"commands/{command['dispatch_id']}/result", token, result
    )
    if containers:
        await api.call(
            "PUT containers",
            "PUT",
            f"nodes/{node_id}/containers",
            token,
            {"containers": containers},
        )


@dataclass
class RouterSeen:
    policy_versions: dict[int, float] = field(default_factory=dict)  # version -> first seen
    deployments: dict[int, float] = field(default_factory=dict)  # count -> first seen


async def router(
    api: Api, name: str, token: str, offset: float, stop: float, seen: RouterSeen
) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(offset)
    _, body, _ = await api.call(
        "POST routers/register",
        "POST",
        "routers/register",
        token,
        {"name": name, "version": "fleet", "listen_url": ""},
    )
    router_id = (body or {}).get("id")
    etags: dict[str, str] = {}
    tick, last_stats = loop.time(), loop.time() - random.uniform(0, ARGS.stats_interval)
    while loop.time() < stop:
        for label, path in (
            ("GET routing/policies", "routing/policies/default"),
            ("GET routing/deployments", "routing/deployments"),
        ):
            headers = {"If-None-Match": etags[path]} if path in etags else {}
            status, data, answer = await api.call(
                label, "GET", path, token, headers=headers, by_status=True
            )
            if status == 200 and data is not None:
                etags[path] = answer.get("etag", "")
                now = time.time()
                if "version" in data:
                    seen.policy_versions.setdefault(int(data["version"]), now)
                else:
                    seen.deployments.setdefault(len(data.get("deployments", [])), now)
        if router_id and loop.time() - last_stats >= ARGS.stats_interval:
            last_stats = loop.time()
            stats = {"policy_version": max(seen.policy_versions, default=1), "request_rate": 0.0}
            await api.call("POST routers/stats", "POST", f"routers/{router_id}/stats", token, stats)
        tick = next_tick(tick, ARGS.router_interval, loop.time())
        await asyncio.sleep(max(0.0, tick - loop.time()))


async def until(predicate: Any, within: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(every)
    return None


async def operator(api: Api, token: str, node: dict[str, Any], ports: tuple[int, int]) -> None:
    """Deploy on the first node, change the policy, benchmark the deployment's GPU engine."""
    events = api.recorder.events
    measure = ARGS.seconds
    await asyncio.sleep(0.1 * measure)
    profile = {
        "name": "fleet-profile",
        "model": "qwen2.5-7b-instruct",
        "engine": "simulator",
        "enable_cpu_engine": False,
        "gpu_port": ports[0],
        "cpu_port": ports[1],
    }
    _, made, _ = await api.call("operator", "POST", "profiles/", token, profile)
    dep = {"name": "fleet-deployment", "profile": (made or {}).get("id"), "node": node["id"]}
    status, deployment, _ = await api.call("operator", "POST", "deployments/", token, dep)
    if deployment is None or "id" not in deployment:
        events["deploy_error"] = float(status or 0)
        print(f"operator: deployment not created: {status} {deployment}", file=sys.stderr)
        return
    dep_id = deployment["id"]
    events["deploy_requested"] = time.time()
    await api.call("operator", "POST", f"deployments/{dep_id}/deploy", token)

    async def running() -> bool:
        _, body, _ = await api.call("operator", "GET", f"deployments/{dep_id}", token)
        return bool(body and body.get("state") == "running")

    if await until(running, within=0.3 * measure):
        events["deploy_running"] = time.time()
    await asyncio.sleep(max(0.0, 0.4 * measure - (time.time() - START_WALL)))
    change = {"cpu_max_batch_size": random.randint(2, 7), "reason": "fleet load"}
    _, policy, _ = await api.call("operator", "PATCH", "policies/default", token, change)
    if policy:
        events["policy_changed"] = time.time()
        events["policy_version"] = float(policy["version"])
    if "deploy_running" not in events:
        return
    run = {
        "scenario": "short",
        "deployment": dep_id,
        "target_url": f"http://{HOST}:{ports[0]}",
        "mode": "gpu",
        "concurrency": [2],
        "iterations": 10,
    }
    status, made_run, _ = await api.call("operator", "POST", "benchmark-runs/", token, run)
    if not made_run or "id" not in made_run:
        print(f"operator: benchmark not started: {status} {made_run}", file=sys.stderr)
        return
    events["benchmark_started"] = time.time()

    async def finished() -> str:
        _, body, _ = await api.call("operator", "GET", f"benchmark-runs/{made_run['id']}", token)
        state = (body or {}).get("status", "")
        return state if state in ("succeeded", "failed", "cancelled") else ""

    outcome = await until(finished, within=0.45 * measure)
    if outcome:
        events["benchmark_finished"] = time.time()
        BENCHMARK["status"] = outcome


async def lost_watch(api: Api, token: str, lost: set[str]) -> None:
    """When beat's reaper has marked every silent node offline. The silent nodes have the
    last names, so offline nodes by name, last first, list them first."""
    events = api.recorder.events
    path = f"nodes/?status=offline&ordering=-name&limit={len(lost)}"

    async def all_offline() -> bool:
        _, body, _ = await api.call("operator", "GET", path, token)
        found = {n["name"] for n in (body or {}).get("results", [])} & lost
        events["lost offline"] = len(found)
        if found and "lost_first_offline" not in events:
            events["lost_first_offline"] = time.time()
        return len(found) == len(lost)

    if await until(all_offline, within=ARGS.seconds + ARGS.period, every=1.0):
        events["lost_all_offline"] = time.time()


# ------------------------------------------------------------------ CPU and database counters


def process_tree(pid: int) -> list[Any]:
    import psutil

    with suppress(psutil.Error):
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    return []


def process_trees(roots: dict[str, int]) -> list[tuple[str, Any]]:
    """Each root's process and its descendants, named by the root's name, from one pass over
    the machine's processes (``Process.children`` makes a pass of its own for each call)."""
    import psutil

    children: dict[int, list[Any]] = defaultdict(list)
    for proc in psutil.process_iter(["ppid"]):
        children[proc.info["ppid"]].append(proc)
    found: list[tuple[str, Any]] = []
    for name, pid in roots.items():
        with suppress(psutil.Error):
            todo = [psutil.Process(pid)]
            while todo:
                proc = todo.pop()
                found.append((name, proc))
                todo.extend(children.get(proc.pid, []))
    return found


class CpuSampler:
    """CPU seconds per group of processes, and the database's backends, once a second."""

    def __init__(self, stack: Stack, db_url: str, db_name: str) -> None:
        self.stack, self.db_url, self.db_name = stack, db_url, db_name
        self.first: dict[tuple[str, int], float] = {}
        self.last: dict[tuple[str, int], float] = {}
        self.backends_max = 0
        self.machine: tuple[float, float] | None = None  # busy CPU seconds, first and last
        self.waits: dict[str, int] = defaultdict(int)  # backend state / wait event -> samples
        self.started = time.monotonic()
        self.stopped = self.started
        # Each sample's cores busy since the one before: (wall time, the machine, per group,
        # the disk: MB written, flushes, milliseconds a flush on average).
        self.timeline: list[tuple[float, float, dict[str, float], tuple[float, ...]]] = []
        self.disk = disk_counters()
        self.steal = self.steal_first = 0.0  # read at each sample, from the first one on
        self.trees: list[tuple[str, Any]] = []
        self.trees_at = float("-inf")
        import psutil

        self.me = psutil.Process()

    def _groups(self) -> Iterator[tuple[str, Any]]:
        import psutil

        # The stack's processes are found again every ten seconds, not every second: the
        # pass over every process on the machine held this process's GIL long enough to
        # make its own event loop late, which times the answers late.
        if time.monotonic() - self.trees_at > 10.0:
            roots = {name: proc.pid for name, proc in self.stack.procs.items()}
            self.trees, self.trees_at = process_trees(roots), time.monotonic()
        yield from self.trees
        yield "load generator (this script)", self.me
        with pg_connect(self.db_url) as conn:
            rows = conn.execute(
                "SELECT pid, state, wait_event_type, wait_event, left(query, 50) "
                "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (self.db_name,),
            ).fetchall()
        self.backends_max = max(self.backends_max, len(rows))
        for _, state, wait_type, wait, query in rows:
            if state == "active":
                self.waits[f"active {wait_type or 'CPU'}:{wait or '-'} {query}"] += 1
            else:
                self.waits[str(state)] += 1
        for pid, *_ in rows:
            with suppress(psutil.Error):
                yield "postgres backends", psutil.Process(pid)

    def sample(self) -> None:
        import psutil

        times = psutil.cpu_times()
        busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
        steal, self.steal = self.steal, getattr(times, "steal", 0.0)
        if self.machine is None:
            steal = self.steal_first = self.steal  # the window starts with this sample
        machine_before = self.machine[1] if self.machine else busy
        self.machine = (self.machine[0] if self.machine else busy, busy)
        before, since = dict(self.last), time.monotonic() - self.stopped
        disk, self.disk = self.disk, disk_counters()
        for group, proc in self._groups():
            with suppress(psutil.Error):
                times = proc.cpu_times()
                seconds = times.user + times.system
                key = (group, proc.pid)
                self.first.setdefault(key, seconds)
                self.last[key] = seconds
        self.stopped = time.monotonic()
        if before and since > 0:
            groups: dict[str, float] = defaultdict(float)
            for key, seconds in self.last.items():
                groups[key[0]] += (seconds - before.get(key, self.first[key])) / since
            # Time the hypervisor ran someone else on our virtual CPUs (counted as busy).
            groups["stolen by the hypervisor"] = (self.steal - steal) / since
            io: tuple[float, ...] = ()
            if disk and self.disk:
                written, flushes, flushing = (b - a for a, b in zip(disk, self.disk, strict=True))
                io = (written * 512 / 1e6 / since, flushes / since, flushing / max(1, flushes))
            self.timeline.append((time.time(), (busy - machine_before) / since, dict(groups), io))

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for key, last in self.last.items():
            out[key[0]] += last - self.first[key]
        first, last = self.machine or (0.0, 0.0)
        # The hypervisor's share of our virtual CPUs: counted busy, yet no process of ours ran.
        out["stolen by the hypervisor"] = self.steal - self.steal_first
        # Everything else on the machine: other people's tests, the kernel, Redis.
        out["everything else"] = max(0.0, (last - first) - sum(out.values()))
        return dict(out)


def offline_nodes(silent: set[str]) -> float:
    """Nodes offline now whose agents never stopped (the reaper's false alarms)."""
    with pg_connect(ARGS.db_url) as conn:
        rows = conn.execute("SELECT name FROM inventory_node WHERE status = 'offline'").fetchall()
    return float(len({name for (name,) in rows} - silent))


def db_counters(db_url: str, db_name: str) -> dict[str, int]:
    with pg_connect(db_url) as conn:
        row = conn.execute(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted "
            "FROM pg_stat_database WHERE datname = %s",
            (db_name,),
        ).fetchone()
    keys = ("commits", "rollbacks", "rows inserted", "rows updated", "rows deleted")
    return dict(zip(keys, (int(v) for v in row), strict=True))


def disk_counters(path: str = "/var/lib/postgresql") -> tuple[int, int, int] | None:
    """Sectors written, flushes completed and milliseconds spent flushing, of the block device
    holding ``path`` (PostgreSQL's files; ``/`` if absent), from ``/proc/diskstats``. A
    flush is what an ``fdatasync`` of the WAL asks of the device. None where the kernel does
    not count flushes (before 5.5) or the device is not found."""
    st = os.stat(path if os.path.exists(path) else "/")
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if len(f) >= 20 and (int(f[0]), int(f[1])) == (major, minor):
            return int(f[9]), int(f[18]), int(f[19])
    return None


def tcp_counters() -> dict[str, int]:
    """This machine's TCP counters that show connections waiting to be accepted: a full
    listen queue drops a SYN, and the client sends it again 1 s later, then 3 s (Linux's
    ``/proc/net/netstat``; every listener on the machine counts)."""
    wanted = {"ListenOverflows": "listen queue overflows", "TCPSynRetrans": "SYN retransmits"}
    lines = Path("/proc/net/netstat").read_text().splitlines()
    found: dict[str, int] = {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            pairs = zip(names.split()[1:], values.split()[1:], strict=True)
            found = {wanted[k]: int(v) for k, v in pairs if k in wanted}
    return found


def busy_others(before: dict[int, tuple[str, float]], ours: set[int]) -> list[tuple[str, float]]:
    """The other processes on this machine that used the most CPU meanwhile."""
    import psutil

    used: dict[str, float] = defaultdict(float)
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        if proc.pid in ours or proc.pid not in before:
            continue
        times = proc.info["cpu_times"]
        if times is None:
            continue
        label, start = before[proc.pid]
        used[label] += times.user + times.system - start
    return sorted(used.items(), key=lambda kv: -kv[1])[:5]


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    import psutil

    out = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        cmd = " ".join((proc.info["cmdline"] or [proc.info["name"] or "?"])[:4])[:70]
        out[proc.pid] = (cmd, times.user + times.system)
    return out


# ------------------------------------------------------------------ steps run inside Django


def step_setup(out: Path) -> dict[str, Any]:
    from django.contrib.auth.models import User

    from controlplane.access.models import MachineCredential, PersonalToken
    from controlplane.inventory.models import Node
    from controlplane.policy.services import ensure_default_policy

    ensure_default_policy()
    names = [f"fleet-{i:05d}" for i in range(ARGS.agents)]
    Node.objects.bulk_create([Node(name=n, address=HOST) for n in names], batch_size=1000)
    nodes = []
    for node in Node.objects.filter(name__in=names).order_by("name"):
        _, token = MachineCredential.issue("agent", f"agent-{node.name}", node=node)
        nodes.append({"id": node.pk, "name": node.name, "token": token})
    routers = []
    for i in range(ARGS.routers):
        name = f"fleet-router-{i:03d}"
        routers.append({"name": name, "token": MachineCredential.issue("router", name)[1]})
    # The load's agents report this very inventory: read once, here, so that a machine whose
    # memory total moves between set-up and load (a VM's balloon) does not make every first
    # PUT a change.
    base = base_inventory()
    if not ARGS.fresh_inventory:
        preload_inventories(Node.objects.filter(name__in=names), base)
    if ARGS.online:
        from django.utils import timezone

        Node.objects.filter(name__in=names).update(
            status="online", last_heartbeat_at=timezone.now()
        )
    user = User.objects.create_superuser("fleet-operator", "", secrets.token_urlsafe(24))
    _, operator_token = PersonalToken.issue(user, "fleet operator")
    out.write_text(
        json.dumps(
            {"nodes": nodes, "routers": routers, "operator": operator_token, "inventory": base}
        )
    )
    return {"nodes": len(nodes), "routers": len(routers)}


def preload_inventories(nodes: Any, base: dict[str, Any]) -> None:
    """What ``PUT nodes/<id>/inventory`` stores, in bulk, so the agents' first PUT finds it
    unchanged (a control plane that restarts under a running fleet). ``--fresh-inventory``
    makes every agent register its hardware instead."""
    from django.db import transaction

    from controlplane.inventory.api.serializers import InventorySerializer
    from controlplane.inventory.models import Accelerator, CpuTopology, Node, NumaNode
    from controlplane.inventory.services import inventory_hash

    cpus, numas, cards, updated = [], [], [], []
    for node in nodes:
        serializer = InventorySerializer(data=node_inventory(base, node.name))
        serializer.is_valid(raise_exception=True)
        payload = serializer.validated_data
        cpu = payload["cpu"]
        cpus.append(
            CpuTopology(
                node=node,
                model_name=cpu.get("model", ""),
                architecture=cpu.get("architecture", ""),
                sockets=cpu["sockets"],
                physical_cores=cpu["physical_cores"],
                threads=cpu["threads"],
                isa_flags=sorted(set(cpu.get("isa_flags", []))),
                memory_total_bytes=cpu.get("memory_total_bytes", 0),
            )
        )
        numas += [
            NumaNode(
                node=node,
                index=n["index"],
                cpus=n["cpus"],
                memory_total_bytes=n.get("memory_total_bytes", 0),
            )
            for n in payload.get("numa_nodes", [])
        ]
        cards += [
            Accelerator(
                node=node,
                kind=a["kind"],
                vendor=a.get("vendor", ""),
                model_name=a.get("model", ""),
                index=a["index"],
                uuid=a["uuid"],
                memory_total_bytes=a.get("memory_total_bytes", 0),
                simulated=bool(a.get("simulated", False)),
            )
            for a in payload.get("accelerators", [])
        ]
        node.inventory_hash = inventory_hash(payload)
        node.hostname, node.agent_version = payload.get("hostname", ""), payload["agent_version"]
        updated.append(node)
    with transaction.atomic():
        CpuTopology.objects.bulk_create(cpus, batch_size=1000)
        NumaNode.objects.bulk_create(numas, batch_size=1000)
        Accelerator.objects.bulk_create(cards, batch_size=1000)
        Node.objects.bulk_update(
            updated, ["inventory_hash", "hostname", "agent_version"], batch_size=500
        )


def _counted(call: Any) -> dict[str, Any]:
    """One in-process request's status, queries and SQL; then the median CPU and wall time
    of 50 more, one after another (no other load: the service time of the endpoint)."""
    from django.db import close_old_connections, connection
    from django.test.utils import CaptureQueriesContext

    close_old_connections()  # as at the start of a real request
    with CaptureQueriesContext(connection) as ctx:
        response = call()
    sql = [q["sql"] for q in ctx.captured_queries if "SAVEPOINT" not in q["sql"]]
    cpu, wall = [], []
    for _ in range(50):
        close_old_connections()
        c0, w0 = time.process_time(), time.perf_counter()
        call()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {
        "status": response.status_code,
        "queries": len(sql),
        "cpu_ms": round(statistics.median(cpu) * 1000, 2),
        "wall_ms": round(statistics.median(wall) * 1000, 2),
        "sql": [s[:120] for s in sql],
    }


def step_queries(tokens: Path) -> dict[str, Any]:
    """Queries of one heartbeat, one command fetch and the two 304s, on the loaded database."""
    from django.test import Client

    from controlplane.inventory.models import Node

    data = json.loads(tokens.read_text())
    agent_node = data["nodes"][1 if len(data["nodes"]) > 1 else 0]
    node = Node.objects.prefetch_related("accelerators").get(pk=agent_node["id"])
    beat = {
        "cpu_percent": 5.0,
        "memory_total_bytes": 1,
        "inventory_hash": node.inventory_hash,
        "accelerators": [
            {"uuid": a.uuid, "utilization_percent": 1.0, "memory_used_bytes": 1}
            for a in node.accelerators.all()
        ],
    }
    agent = Client(HTTP_AUTHORIZATION=f"Bearer {agent_node['token']}")
    router = Client(HTTP_AUTHORIZATION=f"Bearer {data['routers'][0]['token']}")
    out: dict[str, Any] = {}
    path = f"/api/v1/nodes/{node.pk}/heartbeat"
    agent.post(path, beat, content_type="application/json")  # last_used_at is fresh after this
    out["POST heartbeat"] = _counted(
        lambda: agent.post(path, beat, content_type="application/json")
    )
    out["GET agent/commands"] = _counted(
        lambda: agent.get("/api/v1/agent/commands?session=q&wait=0")
    )
    for name, url in (
        ("GET routing/policies 304", "/api/v1/routing/policies/default"),
        ("GET routing/deployments 304", "/api/v1/routing/deployments"),
    ):
        etag = router.get(url)["ETag"]
        out[name] = _counted(lambda url=url, etag=etag: router.get(url, HTTP_IF_NONE_MATCH=etag))
    return out


def step_reaper() -> dict[str, Any]:
    """One reaper pass over every node with ``--stale`` of them silent past the grace period."""
    from datetime import timedelta

    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from controlplane.inventory import services
    from controlplane.inventory.choices import NodeStatus
    from controlplane.inventory.models import Node

    if hasattr(services, "_listening_long_enough"):
        # The pass of a control plane that has been listening for a whole grace period: the
        # guard against judging nodes right after an outage of our own is not what is timed.
        services._listening_long_enough = lambda now, grace: True  # type: ignore[attr-defined]
    mark_lost_nodes = services.mark_lost_nodes
    grace = Node.heartbeat_grace()
    stale_count = min(ARGS.stale, Node.objects.count())
    passes, queries = [], 0
    for attempt in range(3):
        now = timezone.now()
        Node.objects.update(status=NodeStatus.ONLINE, last_heartbeat_at=now)
        stale = Node.objects.order_by("-name").values_list("pk", flat=True)[:stale_count]
        Node.objects.filter(pk__in=list(stale)).update(
            last_heartbeat_at=now - grace - timedelta(seconds=1)
        )
        with CaptureQueriesContext(connection) as ctx:
            start = time.perf_counter()
            lost = mark_lost_nodes()
            passes.append(time.perf_counter() - start)
        queries = len(ctx.captured_queries)
        assert len(lost) == stale_count, (attempt, len(lost))
    return {
        "nodes": Node.objects.count(),
        "stale": stale_count,
        "grace_seconds": grace.total_seconds(),
        "pass_seconds": passes,
        "queries": queries,
    }


def run_step() -> None:
    import django

    django.setup()
    if ARGS.step == "setup":
        answer = step_setup(Path(ARGS.tokens))
    elif ARGS.step == "queries":
        answer = step_queries(Path(ARGS.tokens))
    else:
        answer = step_reaper()
    print(json.dumps(answer))


# ------------------------------------------------------------------ the load


@asynccontextmanager
async def client() -> AsyncIterator[Any]:
    """The simulated machines' one HTTP client (``--client``)."""
    if ARGS.client == "wire":
        # An idle connection is kept 1 s, as aiohttp's is here: under gunicorn's keep-alive.
        pool = wire.ConnectionPool(connect_timeout_s=SPEC_TIMEOUT, max_idle_s=1.0)
        try:
            yield pool
        finally:
            pool.close()
        return
    import aiohttp

    connector = aiohttp.TCPConnector(limit=ARGS.connections, keepalive_timeout=1.0)
    timeout = aiohttp.ClientTimeout(total=SPEC_TIMEOUT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


async def load(base: str, data: dict[str, Any], sampler: CpuSampler) -> dict[str, Any]:
    recorder = Recorder()
    loop = asyncio.get_running_loop()
    period = ARGS.period
    warm_end = loop.time() + (ARGS.warmup if ARGS.warmup is not None else 2 * period)
    stop = warm_end + ARGS.seconds
    ARGS.lost_at = warm_end + 0.2 * ARGS.seconds
    seen = [RouterSeen() for _ in data["routers"]]
    base_inv = data["inventory"]
    async with client() as session:
        api = Api(base, recorder, session, ARGS.connections)
        spread = period / max(1, len(data["nodes"]))
        tasks = [
            asyncio.create_task(agent(api, i, node, base_inv, i * spread, stop))
            for i, node in enumerate(data["nodes"])
        ]
        rspread = ARGS.router_interval / max(1, len(data["routers"]))
        tasks += [
            asyncio.create_task(router(api, r["name"], r["token"], i * rspread, stop, seen[i]))
            for i, r in enumerate(data["routers"])
        ]
        # What the simulated fleet holds lives to the end (5,200 tasks, their connections):
        # without this, each full collection walked it all, 80-96 ms every 10 s, and every
        # answer in flight meanwhile was timed that much late (decision 35). Frozen, a
        # full collection still took 28-47 ms, so they are also made a hundred times rarer.
        # The freeze's own collection (110-190 ms) is made a few seconds before the window,
        # so that the answers it delays are the warm-up's.
        await asyncio.sleep(max(0.0, warm_end - FREEZE_AHEAD - loop.time()))
        freeze_heap()
        thresholds = gc.get_threshold()
        gc.set_threshold(thresholds[0], thresholds[1], 100 * thresholds[2])
        await asyncio.sleep(max(0.0, warm_end - loop.time()))
        recorder.measuring = True
        global START_WALL
        START_WALL = time.time()
        spies = start_profiles(sampler.stack) if ARGS.profile else []
        sampler.sample()
        counters_before = db_counters(ARGS.db_url, ARGS.db_name)
        tcp_before = tcp_counters()
        side = [
            asyncio.create_task(
                operator(api, data["operator"], data["nodes"][0], (ARGS.gpu_port, free_port()))
            ),
            asyncio.create_task(watch_own_loop()),
        ]
        lost = {n["name"] for n in data["nodes"][len(data["nodes"]) - ARGS.lost :]}
        if ARGS.lost:
            side.append(asyncio.create_task(lost_watch(api, data["operator"], lost)))
        while loop.time() < stop:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(sampler.sample)
        recorder.measuring = False
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        counters_after = db_counters(ARGS.db_url, ARGS.db_name)
        tcp_after = tcp_counters()
        # Nodes the reaper took for lost although their agents kept heartbeating.
        recorder.events["offline, not silent"] = await asyncio.to_thread(offline_nodes, lost)
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            await asyncio.to_thread(spy.wait, 30)
        for task in side:
            task.cancel()
        await asyncio.gather(*tasks, *side, return_exceptions=True)
    counters = {k: counters_after[k] - counters_before[k] for k in counters_before}
    tcp = {k: tcp_after[k] - tcp_before.get(k, 0) for k in tcp_after}
    return {"recorder": recorder, "seen": seen, "db": counters, "tcp": tcp}


def start_profiles(stack: Stack) -> list[subprocess.Popen[bytes]]:
    """py-spy on each gunicorn worker (not the master), and on the gateway when there is one,
    for the measured window."""
    ARGS.profile.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    targets = [(f"web-{w.pid}", w.pid) for w in process_tree(stack.procs["web"].pid)[1:]]
    if "gateway" in stack.procs:
        targets.append(("gateway", stack.procs["gateway"].pid))
    return [
        subprocess.Popen(
            [
                str(spy),
                "record",
                "--format",
                "raw",
                "--rate",
                "50",
                "--nonblocking",
                "--threads",
                "--pid",
                str(pid),
                "--output",
                str(ARGS.profile / f"{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in targets
    ]


# ------------------------------------------------------------------ the report


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(
    result: dict[str, Any],
    cpu: dict[str, float],
    extra: dict[str, Any],
    sampler_timeline: list[Any],
    probed: tuple[str, list[tuple[float, float]]],
) -> dict[str, Any]:
    recorder: Recorder = result["recorder"]
    seconds = ARGS.seconds
    rows = []
    print(f"\n{ARGS.agents} agents, {ARGS.routers} routers, {seconds:g} s measured\n")
    print("| endpoint | count | per s | p50 ms | p99 ms | max ms | errors |")
    print("|---|---|---|---|---|---|---|")
    for name in sorted(recorder.endpoints):
        ep = recorder.endpoints[name]
        count = len(ep.latencies) + sum(ep.errors.values())
        lat = [x * 1000 for x in ep.latencies]
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(ep.errors.items())) or "0"
        row = {
            "endpoint": name,
            "count": count,
            "rate": count / seconds,
            "p50_ms": statistics.median(lat) if lat else None,
            "p99_ms": percentile(lat, 0.99) if lat else None,
            "max_ms": max(lat) if lat else None,
            "errors": dict(ep.errors),
        }
        rows.append(row)
        fmt = (lambda v: f"{v:.1f}") if lat else (lambda v: "-")
        print(
            f"| {name} | {count} | {count / seconds:.1f} | {fmt(row['p50_ms'])} | "
            f"{fmt(row['p99_ms'])} | {fmt(row['max_ms'])} | {errors} |"
        )
    print("\nCPU seconds over the measured window (and cores busy):")
    for group, used in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"  {group}: {used:.1f} s ({used / seconds:.2f} cores)")
    beats = len(recorder.endpoints["POST heartbeat"].latencies) or 1
    print("\ndatabase counters:", json.dumps(result["db"]))
    print(f"  per heartbeat: {result['db']['rows updated'] / beats:.1f} rows updated")
    print("TCP over the window, the whole machine:", json.dumps(result["tcp"]))
    events = recorder.events
    timeline = {}
    if "deploy_running" in events:
        timeline["deploy -> running s"] = events["deploy_running"] - events["deploy_requested"]
        seen_at = [
            min(s.deployments[k] for k in s.deployments if k > 0)
            for s in result["seen"]
            if any(k > 0 for k in s.deployments)
        ]
        if len(seen_at) == ARGS.routers:
            timeline["deploy -> every router has it s"] = max(seen_at) - events["deploy_requested"]
    if "policy_changed" in events:
        version = int(events["policy_version"])
        seen_at = [
            s.policy_versions[version] for s in result["seen"] if version in s.policy_versions
        ]
        if len(seen_at) == ARGS.routers:
            timeline["policy change -> every router has it s"] = (
                max(seen_at) - events["policy_changed"]
            )
    if "benchmark_finished" in events:
        timeline[f"benchmark ({BENCHMARK.get('status')}) s"] = (
            events["benchmark_finished"] - events["benchmark_started"]
        )
    timeline["inventories changed by the first PUT"] = events.get("inventories changed", 0)
    timeline["nodes offline at the end, not silent"] = events.get("offline, not silent", 0)
    if "lost_all_offline" in events:
        # From the moment the agents stop; each node's last heartbeat was up to a period
        # before that, and the reaper runs every period: expect grace .. grace + 2 periods.
        timeline[f"{ARGS.lost} silent -> all offline s"] = (
            events["lost_all_offline"] - events["lost_silent_at"]
        )
    print("\noperator:", json.dumps({k: round(v, 2) for k, v in timeline.items()}))
    by_second: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for when, name, took in recorder.slow:
        by_second[int(when)].append((name, took))
    worst = sorted(by_second.items(), key=lambda kv: -max(t for _, t in kv[1]))[:5]
    print("seconds with answers over 100 ms (second: count, worst ms; the count by endpoint):")
    for t, slow in sorted(worst):
        names = Counter(name for name, _ in slow).most_common(3)
        mix = ", ".join(f"{name} {n}" for name, n in names)
        print(f"  {t}: {len(slow)}, {max(took for _, took in slow) * 1000:.0f} ({mix})")
    if not worst:
        print("  none")
    # When the operator and the lost agents acted, to set beside those seconds.
    acted = {k: round(v - START_WALL, 1) for k, v in events.items() if v > START_WALL - 60}
    started = time.strftime("%H:%M:%S", time.localtime(START_WALL))
    print(f"events (seconds into the window, which began at {started}):", json.dumps(acted))
    long = [(round(w - START_WALL, 1), round(t * 1000), g) for w, t, g in COLLECTIONS.long]
    measured = [c for c in long if c[0] >= 0]
    print("the load generator's collections over 20 ms (second, ms, generation):", measured)
    late = [(round(w - START_WALL, 2), round(t * 1000)) for w, t in LOOP_LATE]
    late = [x for x in late if 0 <= x[0] < seconds]
    print(
        f"the load generator's loop ran 20 ms late or more {len(late)} times"
        f" ({sum(1 for _, ms in late if ms >= 100)} of them 100 ms or more); the worst"
        f" (second, ms): {sorted(late, key=lambda x: -x[1])[:8]}"
    )
    # The machine's own stalls: a real-time process's late wake-ups (scripts/bench/stall_probe.py).
    scheduler, stalls = probed
    window = [(w - START_WALL, ms) for w, ms in stalls if 0 <= w - START_WALL < seconds]
    late_by_second: dict[int, float] = defaultdict(float)
    for at, ms in window:
        late_by_second[int(at)] = max(late_by_second[int(at)], ms)
    print(
        f"the machine's stalls ({scheduler} probe, wake-ups 20 ms late or more): {len(window)},"
        f" over 100 ms: {sum(ms >= 100 for _, ms in window)}; the worst (second, ms):",
        sorted(((round(a, 1), ms) for a, ms in window), key=lambda x: -x[1])[:8],
    )
    print(
        "cores busy in the seconds around those (the machine; the busiest groups; the disk: "
        "MB written and flushes a second, ms a flush on average; the probe's latest wake-up):"
    )
    around = {t + d for t, _ in worst for d in (-1, 0, 1)}
    for when, machine, groups, io in sampler_timeline:
        # A sample covers the second before it was taken.
        second = int(when - START_WALL)
        if second in around:
            top = sorted(groups.items(), key=lambda kv: -kv[1])[:4]
            disk = f"; disk {io[0]:.1f} MB/s, {io[1]:.0f} flushes/s of {io[2]:.1f} ms" if io else ""
            late = late_by_second.get(second - 1, 0.0)
            print(
                f"  {second}: {machine:.2f};",
                ", ".join(f"{g} {c:.2f}" for g, c in top) + disk + f"; probe {late:.0f} ms",
            )
    for key, value in extra.items():
        print(f"\n{key}: {json.dumps(value)}")
    sizes = {"agents": ARGS.agents, "routers": ARGS.routers, "seconds": seconds}
    return {
        **sizes,
        "rows": rows,
        "cpu": cpu,
        "db": result["db"],
        "tcp": result["tcp"],
        "timeline": timeline,
        "machine_stalls": {"probe": scheduler, "late_ms_at": window},
        # Every answer over 100 ms: (seconds into the window it came, endpoint, its seconds).
        "slow_answers": [(round(w, 4), name, round(t, 4)) for w, name, t in recorder.slow],
        **extra,
    }


# ------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--agents", type=int, default=200)
    p.add_argument("--routers", type=int, default=20)
    p.add_argument("--seconds", type=float, default=20.0, help="measured, after one period")
    p.add_argument("--period", type=float, default=10.0, help="heartbeat interval (s)")
    p.add_argument("--router-interval", type=float, default=1.0)
    p.add_argument("--stats-interval", type=float, default=10.0)
    p.add_argument("--connections", type=int, default=100, help="client connection limit")
    p.add_argument("--workers", type=int, default=2, help="syshax web --workers")
    p.add_argument("--threads", type=int, default=4, help="syshax web --threads")
    p.add_argument("--lost", type=int, default=0, help="agents that stop heartbeating")
    p.add_argument("--stale", type=int, default=50, help="silent nodes in the reaper pass")
    p.add_argument(
        "--reaper-only", action="store_true", help="set up the nodes, time the reaper, no load"
    )
    p.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/13")
    p.add_argument("--no-celery", action="store_true", help="no worker, beat or benchmark")
    p.add_argument(
        "--online",
        action="store_true",
        help="the nodes start online, as a control plane restarted under a running fleet "
        "finds them (default: pending, so each first heartbeat brings its node online)",
    )
    p.add_argument(
        "--gateway",
        action="store_true",
        help="put `syshax gateway` in front of `syshax web`, as the machines' address",
    )
    p.add_argument(
        "--gateway-switch-interval",
        type=float,
        help="the gateway's --switch-interval (default: its own)",
    )
    p.add_argument(
        "--long-poll",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="agents hold their command fetch open up to SECONDS, as the real agent does"
        " (needs --gateway: Django holds a web thread for each; default 0: fetch once a"
        " heartbeat)",
    )
    p.add_argument(
        "--fresh-inventory",
        action="store_true",
        help="nodes start with no inventory: every agent's first PUT stores its hardware "
        "(default: stored in setup, so the PUT finds it unchanged)",
    )
    p.add_argument("--keep-db", action="store_true")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument(
        "--profile",
        type=Path,
        help="py-spy each web worker and the gateway over the window (collapsed stacks)",
    )
    p.add_argument("--logs", type=Path, help="keep each service's log in this folder")
    p.add_argument("--warmup", type=float, help="seconds before measuring (default: two periods)")
    p.add_argument(
        "--client",
        choices=["wire", "aiohttp"],
        default="wire",
        help="the simulated machines' HTTP client: bare asyncio protocols (default), or aiohttp",
    )
    p.add_argument(
        "--loop",
        choices=["uvloop", "asyncio"],
        default="uvloop",
        help="the load generator's event loop (default uvloop; asyncio's own cost it a third"
        " more CPU, which it shares with what it measures)",
    )
    p.add_argument(
        "--versus",
        type=Path,
        metavar="TREE",
        help="with --gateway: alternate runs of the gateway of the checkout TREE with this"
        " one's, --repeat times each, and print the medians side by side",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="runs of each side with --versus (default 3)"
    )
    p.add_argument("--gateway-tree", type=Path, help=argparse.SUPPRESS)  # a --versus run's
    p.add_argument("--step", choices=["setup", "queries", "reaper"], help=argparse.SUPPRESS)
    p.add_argument("--tokens", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.long_poll < 0:
        p.error(f"--long-poll must be 0 or more seconds, not {args.long_poll:g}")
    if args.versus and not (args.gateway and (args.versus / "controlplane").is_dir()):
        p.error("--versus needs --gateway and a checkout of this project (its controlplane/)")
    if args.long_poll and not (args.gateway and args.client == "wire"):
        p.error(
            "--long-poll needs --gateway (Django holds a web thread for each held fetch) and"
            " --client wire (aiohttp's connection limit would hold them in its queue)"
        )
    return args


def flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


def wait_healthy(base: str, stack: Stack, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in stack.procs.items():
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with {proc.returncode}; see {stack.logs}")
        with suppress(httpx.HTTPError):
            if httpx.get(base + "health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise SystemExit(f"the control plane did not answer health in {timeout:g} s")


# ------------------------------------------------------------------ two gateways side by side

# What --versus prints of each run: the figure, and where it is in the run's JSON.
COMPARED: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (
    ("heartbeats/s", lambda f: _row(f, "POST heartbeat")["rate"]),
    ("heartbeat p50 ms", lambda f: _row(f, "POST heartbeat")["p50_ms"]),
    ("heartbeat p99 ms", lambda f: _row(f, "POST heartbeat")["p99_ms"]),
    ("fetch p99 ms", lambda f: _row(f, "GET agent/commands")["p99_ms"]),
    ("policy 304 p99 ms", lambda f: _row(f, "GET routing/policies 304")["p99_ms"]),
    ("stats p99 ms", lambda f: _row(f, "POST routers/stats")["p99_ms"]),
    ("errors", lambda f: sum(sum(r["errors"].values()) for r in f["rows"])),
    ("gateway cores", lambda f: f["cpu"].get("gateway", 0.0) / f["seconds"]),
    ("gateway CPU ms an answer", lambda f: 1000 * f["cpu"].get("gateway", 0.0) / _answers(f)),
    ("web cores", lambda f: f["cpu"].get("web", 0.0) / f["seconds"]),
    # What else ran: batches grow when the machine is busy, and a heartbeat then costs less.
    ("other cores", lambda f: f["cpu"].get("everything else", 0.0) / f["seconds"]),
)


def _answers(figures: dict[str, Any]) -> int:
    """Requests answered in the measured window (the inventory PUTs are counted from the
    start)."""
    return max(1, sum(r["count"] for r in figures["rows"] if r["endpoint"] != "PUT inventory"))


def _row(figures: dict[str, Any], endpoint: str) -> dict[str, Any]:
    return next(r for r in figures["rows"] if r["endpoint"] == endpoint)


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less ``options`` and their values."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in options)):
            out.append(arg)
    return out


def versus() -> int:
    """This command's run, --repeat times, alternating the gateway of --versus and this one's
    (the other first); each in a child process of its own, set-up included."""
    argv = _without(sys.argv[1:], ("--versus", "--repeat", "--json", "--gateway-tree"))
    sides = {f"{ARGS.versus}": ["--gateway-tree", str(ARGS.versus.resolve())], "this tree": []}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="fleet-versus-") as tmp:
        for n in range(ARGS.repeat):
            for side, extra in sides.items():
                out = Path(tmp) / f"{len(runs[side])}-{side.replace('/', '_')}.json"
                print(f"\n=== run {n + 1} of {ARGS.repeat}: {side}", flush=True)
                cmd = [sys.executable, __file__, *argv, *extra, "--json", str(out)]
                subprocess.run(cmd, check=True, cwd=ROOT)
                figures = json.loads(out.read_text())
                runs[side].append(figures)
                print(json.dumps({name: round(get(figures), 3) for name, get in COMPARED}))
    summary = {
        side: {name: statistics.median(get(f) for f in figures) for name, get in COMPARED}
        for side, figures in runs.items()
    }
    print(f"\nmedians of {ARGS.repeat} runs each, alternating:")
    print("| gateway | " + " | ".join(name for name, _ in COMPARED) + " |")
    print("|---|" + "---|" * len(COMPARED))
    for side, figures in summary.items():
        print(f"| {side} | " + " | ".join(f"{v:.2f}" for v in figures.values()) + " |")
    if ARGS.json:
        ARGS.json.write_text(json.dumps({"medians": summary, "runs": runs}, indent=2))
    return 0


def main() -> int:
    if ARGS.step:
        run_step()
        return 0
    if ARGS.versus:
        return versus()
    gc.callbacks.append(COLLECTIONS)
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp, fleet_database(ARGS.postgres) as url:
        var_dir = Path(tmp)
        ARGS.db_url, ARGS.db_name = url, url.rsplit("/", 1)[1]
        env = server_env(url, ARGS.redis, var_dir, ARGS.period)
        flush_redis(ARGS.redis)
        started = time.monotonic()
        subprocess.run(syshax("manage", "migrate", "--verbosity", "0"), env=env, check=True)
        tokens = var_dir / "tokens.json"
        made = in_django(env, "setup", *_sizes(), "--tokens", str(tokens))
        print(f"set up {made} in {time.monotonic() - started:.1f} s", flush=True)
        if ARGS.reaper_only:
            print("reaper pass:", json.dumps(in_django(env, "reaper", *_sizes())))
            return 0
        data = json.loads(tokens.read_text())
        if ARGS.logs:
            ARGS.logs.mkdir(parents=True, exist_ok=True)
        stack = Stack(env, ARGS.logs or var_dir)
        port, ARGS.gpu_port = free_port(), free_port()
        web_port = free_port() if ARGS.gateway else port
        web = ["web", "--bind", f"{HOST}:{web_port}", "--no-migrate"]
        stack.start(
            "web", syshax(*web, "--workers", str(ARGS.workers), "--threads", str(ARGS.threads))
        )
        if ARGS.gateway:
            upstream = f"http://{HOST}:{web_port}"
            stack.start(
                "gateway",
                syshax(
                    "gateway",
                    "--bind",
                    f"{HOST}:{port}",
                    "--upstream",
                    upstream,
                    *(
                        ("--switch-interval", str(ARGS.gateway_switch_interval))
                        if ARGS.gateway_switch_interval
                        else ()
                    ),
                ),
                cwd=ARGS.gateway_tree or ROOT,
                LOG_LEVEL="INFO",  # its counts, every 30 s
            )
        if not ARGS.no_celery:
            stack.start("worker", syshax("worker", "--concurrency", "1", "--loglevel", "WARNING"))
            bench = ("worker", "--queues", "benchmarks", "--concurrency", "1")
            stack.start("benchmarks", syshax(*bench, "--loglevel", "WARNING"))
            stack.start("beat", syshax("beat", "--loglevel", "WARNING"))
            sim = ["sim", "--device", "a100-80gb", "--model", "qwen2.5-7b-instruct"]
            stack.start(
                "engine (syshax sim)", syshax(*sim, "--port", str(ARGS.gpu_port), "--speed", "20")
            )
        base = f"http://{HOST}:{port}/api/v1/"
        others_before = cpu_snapshot()
        stalls_at = var_dir / "stalls.jsonl"
        probe = subprocess.Popen([sys.executable, str(HERE / "stall_probe.py"), str(stalls_at)])
        try:
            wait_healthy(base, stack)
            sampler = CpuSampler(stack, url, ARGS.db_name)
            factory = uvloop.new_event_loop if ARGS.loop == "uvloop" else asyncio.new_event_loop
            with asyncio.Runner(loop_factory=factory) as runner:
                result = runner.run(load(base, data, sampler))
            ours = {p.pid for proc in stack.procs.values() for p in process_tree(proc.pid)}
            ours |= {pid for _, pid in sampler.last} | {os.getpid()}
            others = busy_others(others_before, ours)
        finally:
            probe.terminate()
            probe.wait()
            stack.stop()
        scheduler, stalls = stall_probe.read(str(stalls_at))
        # One request after another, each counted: not throttled (the throttle still runs).
        unthrottled = {**env, "MACHINE_RATE_LIMIT": "100000/s"}
        queries = in_django(unthrottled, "queries", "--tokens", str(tokens))
        reaper = in_django(env, "reaper", *_sizes())
        extra = {
            "in-process, one at a time (queries, median CPU ms, median wall ms)": {
                k: [v["queries"], v["cpu_ms"], v["wall_ms"]] for k, v in queries.items()
            },
            "reaper pass": reaper,
            "backends (max)": sampler.backends_max,
            "backend states (samples)": dict(
                sorted(sampler.waits.items(), key=lambda kv: -kv[1])[:12]
            ),
            "busiest other processes (CPU s)": [(n, round(s, 1)) for n, s in others],
            "setup": {
                "web": f"{ARGS.workers} workers x {ARGS.threads} threads",
                "gateway": bool(ARGS.gateway),
                "gateway switch interval": ARGS.gateway_switch_interval,
                "load generator's client": ARGS.client,
                "long poll s": ARGS.long_poll,
            },
        }
        figures = report(result, sampler.totals(), extra, sampler.timeline, (scheduler, stalls))
        figures["queries_sql"] = queries
        if ARGS.json:
            ARGS.json.write_text(json.dumps(figures, indent=2, default=str))
        flush_redis(ARGS.redis)
    return 0


def _sizes() -> list[str]:
    sizes = [
        "--agents",
        str(ARGS.agents),
        "--routers",
        str(ARGS.routers),
        "--stale",
        str(ARGS.stale),
    ]
    if ARGS.fresh_inventory:
        sizes.append("--fresh-inventory")
    if ARGS.online:
        sizes.append("--online")
    return sizes


NODES: list[Any] = []
BENCHMARK: dict[str, str] = {}
START_WALL = time.time()

if __name__ == "__main__":
    ARGS = parse_args()
    NODES = [None] * ARGS.agents
    sys.exit(main())
