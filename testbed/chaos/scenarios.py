"""The chaos scenarios: each injects one fault in the middle of deploys or of client load,
recovers, and measures what an operator and a client would see.

* lost: deploy steps of a generation with no succeeded command, when the deployment had not
  reached ``running`` by the recovery deadline (REST: the deployment and ``commands/``);
* run twice: extra runtime starts of one engine, i.e. more than one launcher for a
  (generation, role) in the engine ledger (a launcher restarting a dead engine is a restart,
  not a second start), or two engines of one role alive at the end; engines of an older
  generation still alive at the end are counted apart, as orphans;
* client errors: requests of the load client that got a non-200, a broken or short stream,
  or an error event;
* recovery: fault end -> the deployment ``running`` at the generation asked for, the node
  online with a fresh heartbeat (so a reaper that has yet to run after an outage cannot take
  it away a moment later) and the router serving: both backends up and a probe through each
  route whole.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from testbed.chaos.load import LoadClient
from testbed.chaos.stack import MODEL, ChaosStack, wait_for

DEPLOY_STEPS = ("stop-old-cpu", "stop-old-gpu", "start-gpu", "start-cpu")
# Where the fault lands in successive deploys: "requested" is the moment the deploy was asked
# for (the workflow's first task in flight), a step name the moment that step's command
# exists (its engine start or stop under way). The agent mid-start is the longest window.
TRIGGERS = ("start-gpu", "requested", "start-cpu", "stop-old-gpu")
# The worker is busy only while the workflow advances: hit it there first.
WORKER_TRIGGERS = ("requested", "start-gpu", "start-cpu", "stop-old-gpu")


@dataclass(frozen=True)
class Durations:
    down_s: float = 5.0  # how long a killed worker, agent, Redis or PostgreSQL stays down
    redis_pause_s: float = 30.0
    control_plane_down_s: float = 60.0
    deploys: int = 4  # deploys per deploy scenario, each hit at the next trigger
    warmup_s: float = 5.0  # load before the fault
    after_s: float = 10.0  # load kept after recovery
    clients: int = 8
    max_tokens: int = 48
    # Longer than every timer of the control plane's own recovery: resume_in_flight (60 s) and
    # the re-offer of a command without a result (30 s beat, 60 s + the health timeout).
    recovery_deadline_s: float = 180.0

    @classmethod
    def quick(cls) -> Durations:
        return cls(
            down_s=1.0,
            redis_pause_s=3.0,
            control_plane_down_s=6.0,
            deploys=1,
            warmup_s=2.0,
            after_s=3.0,
            clients=4,
            max_tokens=32,
            recovery_deadline_s=180.0,
        )


@dataclass
class ScenarioResult:
    name: str
    fault: str
    lost: int = 0
    run_twice: int = 0
    client_errors: int | None = None  # None: no client load in this scenario
    recovery_s: float | None = None  # None: it never recovered
    orphans: int = 0
    exits: list[str] = field(default_factory=list)  # processes that exited on their own
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def missed(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{self.lost} lost")
        if self.run_twice:
            out.append(f"{self.run_twice} run twice")
        if self.orphans:
            out.append(f"{self.orphans} orphaned engine(s)")
        if self.client_errors:
            out.append(f"{self.client_errors} client error(s)")
        if self.recovery_s is None:
            out.append("never recovered")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "missed": self.missed}


# ---------------------------------------------------------------- shared checks


def settle(stack: ChaosStack, deadline: float, *, redeploy: bool = False) -> None:
    """Bring the stack back to a clean start for the next scenario: every process up, the
    deployment running, the router serving. ``redeploy``: a deployment that is not running is
    deployed again at once (what an operator does with a stuck one), else one still deploying
    or unknown gets ``deadline`` to come back by itself."""
    if stack.redis.process is None or stack.redis.process.poll() is not None:
        stack.redis.start()
    else:
        stack.redis.resume()
    if stack.postgres.pid is None:
        stack.postgres.start()
    for proc in stack.procs.values():
        if not proc.alive:
            proc.start()
    found = wait_for(stack.deployment, 60, "the API")
    current = stack.deployment()
    if found is None or current is None:
        raise RuntimeError("the control plane does not answer")
    generation = int(current["generation"])
    if current["state"] != "running":
        if redeploy or current["state"] not in ("deploying", "unknown"):
            generation = stack.deploy()
        if (
            wait_for(lambda: stack.deployment_at("running", generation), deadline, "running")
            is None
        ):
            raise RuntimeError(f"the deployment does not run again: {stack.deployment()}")
    if wait_for(partial(stack.healthy_at, generation), deadline, "the whole system") is None:
        raise RuntimeError(
            f"not healthy: deployment {stack.deployment()}, node fresh {stack.node_fresh()}, "
            f"router {stack.router_health()}"
        )


def current_generation(stack: ChaosStack) -> int:
    found = stack.deployment()
    assert found is not None
    return int(found["generation"])


def engine_counts(
    stack: ChaosStack, result: ScenarioResult, generations: set[int], since: float = 0.0
) -> None:
    """Run-twice, restarts and orphans of ``generations`` for the engine starts from ``since``
    (wall clock) on, from the ledger and /proc. One launcher per (generation, role): any other
    launcher is a second runtime start; further starts under one launcher are its restarts."""
    starts = [
        s
        for s in stack.engine_starts()
        if s.deployment == stack.deployment_id and s.generation in generations
    ]
    launchers: dict[tuple[int, str], dict[int, float]] = {}
    for start in starts:
        launchers.setdefault((start.generation, start.role), {}).setdefault(start.launcher, start.t)
    new_launchers = 0
    for (gen, role), first in sorted(launchers.items()):
        new = sum(1 for t in first.values() if t >= since)
        twice = new if len(first) > new else max(0, new - 1)
        new_launchers += new
        result.run_twice += twice
        if twice:
            result.notes.append(f"g{gen} {role} engine started {len(first)} times")
    # The deployment's generation now: a stuck deploy is followed by a fresh one (settle).
    final = max(generations | {current_generation(stack)})
    alive = list(stack.running_engines().values())
    result.orphans = sum(1 for gen, _ in alive if gen != final)
    for role in ("gpu", "cpu"):
        count = sum(1 for gen, r in alive if gen == final and r == role)
        if count > 1:
            result.run_twice += count - 1
            result.notes.append(f"{count} g{final} {role} engines alive at the end")
    result.details.update(
        engine_starts=dict(
            Counter(f"g{s.generation}-{s.role}" for s in starts if s.t >= since).most_common()
        ),
        launcher_restarts=sum(1 for s in starts if s.t >= since) - new_launchers,
        engines_alive_at_end=sorted(f"g{g}-{r}" for g, r in alive),
    )


# ---------------------------------------------------------------- deploy scenarios


def _step_dispatched(stack: ChaosStack, generation: int, step: str) -> bool:
    commands = stack.commands(generation) or []
    return any(c["step"] == step for c in commands)


def _lost_steps(stack: ChaosStack, generation: int) -> list[str]:
    wait_for(lambda: stack.commands(generation) is not None, 60, "the commands")
    commands = stack.commands(generation) or []
    done = {c["step"] for c in commands if c["status"] == "succeeded"}
    return [step for step in DEPLOY_STEPS if step not in done] or ["deployment"]


def deploy_scenario(
    stack: ChaosStack,
    d: Durations,
    name: str,
    fault: str,
    inject: Callable[[], None],
    recover: Callable[[], None],
    hold_s: float,
    triggers: tuple[str, ...] = TRIGGERS,
) -> ScenarioResult:
    result = ScenarioResult(name, fault)
    generations: set[int] = set()
    recoveries: list[float | None] = []
    for index in range(d.deploys):
        trigger = triggers[index % len(triggers)]
        generation = stack.deploy()
        generations.add(generation)
        if trigger != "requested" and (
            wait_for(partial(_step_dispatched, stack, generation, trigger), 30, trigger, 0.05)
            is None
        ):
            result.notes.append(f"g{generation}: {trigger} was never dispatched before the fault")
        inject()
        time.sleep(hold_s)
        recover()
        ended = time.monotonic()
        deadline = ended + d.recovery_deadline_s
        running = wait_for(
            partial(stack.deployment_at, "running", generation), d.recovery_deadline_s, "running"
        )
        served = (
            wait_for(
                partial(stack.healthy_at, generation),
                max(1.0, deadline - time.monotonic()),
                "the whole system",
            )
            if running is not None
            else None
        )
        recoveries.append(None if served is None else round(served - ended, 2))
        if running is None:
            lost = _lost_steps(stack, generation)
            result.lost += len(lost)
            found = stack.deployment() or {}
            result.notes.append(
                f"g{generation} (fault at {trigger}): still {found.get('state')!r} after "
                f"{d.recovery_deadline_s:.0f} s; never completed: {', '.join(lost)}"
            )
        commands = stack.commands(generation) or []
        result.details.setdefault("deploys", []).append(
            {
                "generation": generation,
                "fault_at": trigger,
                "recovery_s": recoveries[-1],
                "commands": {c["step"]: [c["status"], c["attempts"]] for c in commands},
            }
        )
        if served is None:
            settle(stack, d.recovery_deadline_s, redeploy=True)
    engine_counts(stack, result, generations)
    result.recovery_s = None if None in recoveries else max(r or 0.0 for r in recoveries)
    return result


def worker_kill(stack: ChaosStack, d: Durations) -> ScenarioResult:
    worker = stack.procs["worker"]
    return deploy_scenario(
        stack,
        d,
        "worker-kill",
        "kill -9 of the Celery worker",
        worker.kill,
        worker.start,
        d.down_s,
        WORKER_TRIGGERS,
    )


def agent_kill(stack: ChaosStack, d: Durations) -> ScenarioResult:
    agent = stack.procs["agent"]
    return deploy_scenario(
        stack, d, "agent-kill", "kill -9 of the node agent", agent.kill, agent.start, d.down_s
    )


def redis_kill(stack: ChaosStack, d: Durations) -> ScenarioResult:
    redis = stack.redis
    fault = "kill -9 of Redis (restarted empty)"
    return deploy_scenario(stack, d, "redis-kill", fault, redis.kill, redis.start, d.down_s)


def postgres_kill(stack: ChaosStack, d: Durations) -> ScenarioResult:
    pg = stack.postgres
    return deploy_scenario(
        stack, d, "postgres-kill", "kill -9 of PostgreSQL", pg.kill, pg.start, d.down_s
    )


def redis_pause(stack: ChaosStack, d: Durations) -> ScenarioResult:
    redis = stack.redis
    return deploy_scenario(
        stack,
        d,
        "redis-pause",
        f"SIGSTOP of Redis for {d.redis_pause_s:g} s",
        redis.pause,
        redis.resume,
        d.redis_pause_s,
    )


# ---------------------------------------------------------------- load scenarios


def control_plane_down(stack: ChaosStack, d: Durations) -> ScenarioResult:
    result = ScenarioResult(
        "control-plane-down",
        f"web, worker and beat killed for {d.control_plane_down_s:g} s under client load",
    )
    generation = current_generation(stack)
    since = time.time()
    states: list[str] = []

    def recovered() -> bool:
        found = stack.deployment()
        if found is None:
            return False
        if not states or states[-1] != found["state"]:
            states.append(str(found["state"]))
        return stack.healthy_at(generation)

    with LoadClient(stack.router_url, MODEL, clients=d.clients, max_tokens=d.max_tokens) as load:
        time.sleep(d.warmup_s)
        faulted = time.monotonic()
        stack.kill_control_plane()
        time.sleep(d.control_plane_down_s)
        stack.start_control_plane()
        ended = time.monotonic()
        done = wait_for(recovered, d.recovery_deadline_s, "the control plane's view")
        time.sleep(d.after_s)
    result.recovery_s = None if done is None else round(done - ended, 2)
    _load_figures(result, load, faulted, ended)
    result.details["deployment_states_after_restart"] = states
    engine_counts(stack, result, {generation}, since)
    return result


def _load_figures(result: ScenarioResult, load: LoadClient, faulted: float, ended: float) -> None:
    stats = load.stats
    result.client_errors = len(stats.errors)
    result.details["load"] = stats.summary()
    if stats.errors:
        offsets = [round(e.t - faulted, 1) for e in stats.errors]
        result.details["error_offsets_s"] = offsets
        kinds = sorted({e.kind for e in stats.errors})
        result.notes.append(
            f"{len(stats.errors)} client error(s) ({', '.join(kinds)}) "
            f"{min(offsets):.1f}-{max(offsets):.1f} s after the fault: "
            f"{stats.errors[0].detail[:120]}"
        )
    result.details["fault_window_s"] = round(ended - faulted, 2)


def engine_kill(stack: ChaosStack, d: Durations, role: str) -> ScenarioResult:
    mode, probe_mode, route = (
        ("forced-pd", "forced-pd", "pd") if role == "cpu" else ("auto", "gpu-only", "gpu-only")
    )
    result = ScenarioResult(
        f"{role}-engine-kill",
        f"kill -9 of the {role.upper()} engine mid-stream ({mode} load)",
    )
    generation = current_generation(stack)
    since = time.time()
    fallbacks = stack.router_counters("syshax_router_fallbacks_total")
    with LoadClient(
        stack.router_url, MODEL, clients=d.clients, max_tokens=d.max_tokens, mode=mode
    ) as load:
        time.sleep(d.warmup_s)
        (victim,) = stack.engine_pids(role)
        faulted = time.monotonic()
        os.kill(victim, signal.SIGKILL)  # the engine itself; its launcher restarts it

        def recovered() -> bool:
            replaced = [pid for pid in stack.engine_pids(role) if pid != victim]
            return bool(replaced) and stack.router_backends_up() and stack.probe(probe_mode, route)

        done = wait_for(recovered, d.recovery_deadline_s, "the engine back in the router")
        time.sleep(d.after_s)
    result.recovery_s = None if done is None else round(done - faulted, 2)
    _load_figures(result, load, faulted, faulted)
    after = stack.router_counters("syshax_router_fallbacks_total")
    result.details["router_fallbacks"] = {
        kind: after[kind] - fallbacks.get(kind, 0.0)
        for kind in after
        if after[kind] - fallbacks.get(kind, 0.0)
    }
    engine_counts(stack, result, {generation}, since)
    return result


def cpu_engine_kill(stack: ChaosStack, d: Durations) -> ScenarioResult:
    return engine_kill(stack, d, "cpu")


def gpu_engine_kill(stack: ChaosStack, d: Durations) -> ScenarioResult:
    return engine_kill(stack, d, "gpu")


SCENARIOS: dict[str, Callable[[ChaosStack, Durations], ScenarioResult]] = {
    "worker-kill": worker_kill,
    "agent-kill": agent_kill,
    "redis-kill": redis_kill,
    "postgres-kill": postgres_kill,
    "redis-pause": redis_pause,
    "control-plane-down": control_plane_down,
    "cpu-engine-kill": cpu_engine_kill,
    "gpu-engine-kill": gpu_engine_kill,
}


def baseline_deploy(stack: ChaosStack, runs: int) -> float:
    """Median seconds of a fault-free redeploy until the router serves it: the yardstick for
    the recovery column."""
    times = []
    for _ in range(runs):
        began = time.monotonic()
        generation = stack.deploy()
        wait_for(partial(stack.deployment_at, "running", generation), 120, "running")
        wait_for(stack.router_serves, 60, "the router")
        times.append(time.monotonic() - began)
    return round(statistics.median(times), 2)


def run_scenario(stack: ChaosStack, d: Durations, name: str) -> ScenarioResult:
    """Run one scenario from a settled stack; a crash of the harness itself is a result too."""
    try:
        settle(stack, d.recovery_deadline_s)
    except Exception as exc:  # the table must still show it
        result = ScenarioResult(name, "the stack did not settle before the scenario")
        result.notes.append(f"{type(exc).__name__}: {exc}"[:500])
        return result
    began = time.monotonic()
    try:
        result = SCENARIOS[name](stack, d)
    except Exception as exc:
        result = ScenarioResult(name, "harness error")
        result.notes.append(f"{type(exc).__name__}: {exc}"[:500])
    for gone in stack.exits_since(began):
        result.exits.append(f"{gone.name} exited with {gone.returncode}: {gone.last_error}")
    return result
