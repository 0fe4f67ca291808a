"""The accuracy and capacity checks: run the generator against a simulated engine and compare
its timings with the engine's own. Used by ``scripts/loadgen_*.py`` and the tests."""

from __future__ import annotations

from dataclasses import dataclass

from loadgen.accuracy import (
    Agreement,
    EngineTiming,
    arrival_delays,
    compare,
    parse_engine_requests,
)
from loadgen.client import StreamClient, discover_model, make_session
from loadgen.runner import LoadSpec, RunResult, run_load
from loadgen.simproc import fetch_sim_requests
from loadgen.stats import Distribution, distribution
from loadgen.wire import ConnectionPool
from loadgen.workload import build_requests


@dataclass
class Measured:
    """A run of the generator and the engine's record of the same requests."""

    result: RunResult
    engine: dict[str, EngineTiming]


async def measure(
    base_url: str,
    *,
    requests: int,
    concurrency: int,
    input_tokens: int,
    output_tokens: int,
    seed: int = 0,
    warmup: int = 0,
    busy_poll: bool = False,
) -> Measured:
    """Run ``requests`` closed-loop at ``concurrency`` and fetch the engine's timings."""
    async with make_session() as session:
        model = await discover_model(session, base_url)
        pool = ConnectionPool()
        try:
            client = StreamClient(pool, base_url, model)
            specs = build_requests(requests, input_tokens, output_tokens, seed)
            warm = build_requests(
                warmup, input_tokens, output_tokens, seed + 1, first_index=requests
            )
            result = await run_load(
                client, specs, LoadSpec(concurrency), warmup=warm, busy_poll=busy_poll
            )
        finally:
            pool.close()
        engine = parse_engine_requests(await fetch_sim_requests(session, base_url))
    return Measured(result, engine)


@dataclass
class AccuracyReport:
    since: str  # which engine instants: "token" or "emitted" (EngineTiming.times)
    agreements: list[Agreement]
    failed: int

    @property
    def disagreeing(self) -> list[Agreement]:
        return [a for a in self.agreements if not a.ok]

    @property
    def ok(self) -> bool:
        return self.failed == 0 and bool(self.agreements) and not self.disagreeing

    def lines(self) -> list[str]:
        """Medians side by side, then the worst disagreement, in milliseconds."""
        rows = [f"against the engine's {self.since} times:"]
        ttft = [(a.client_ttft_ms, a.engine_ttft_ms) for a in self.agreements]
        tpot = [
            (a.client_tpot_ms, a.engine_tpot_ms)
            for a in self.agreements
            if a.client_tpot_ms is not None and a.engine_tpot_ms is not None
        ]
        for name, pairs in (("TTFT", ttft), ("TPOT", tpot)):
            if not pairs:
                continue
            client = distribution([c / 1000.0 for c, _ in pairs])
            engine = distribution([e / 1000.0 for _, e in pairs])
            errors = distribution([abs(c - e) / 1000.0 for c, e in pairs])
            assert client.median is not None and engine.median is not None
            rows.append(
                f"  {name}: generator median {client.median:.3f} ms, engine median "
                f"{engine.median:.3f} ms, ratio {client.median / engine.median:.4f}; "
                f"|difference| median {errors.median:.3f} ms, max {errors.max:.3f} ms"
            )
        rows.append(
            f"  {len(self.agreements)} requests compared, {len(self.disagreeing)} outside "
            f"max(1 ms, 5 %), {self.failed} failed"
        )
        return rows


def engine_reports_emission(measured: Measured) -> bool:
    """Whether the engine recorded a socket write for every token of every successful request."""
    timings = [measured.engine.get(r.response_id) for r in measured.result.records if r.ok]
    return bool(timings) and all(t is not None and t.emitted_times for t in timings)


def accuracy_report(measured: Measured, since: str = "token") -> AccuracyReport:
    records = measured.result.records
    failed = sum(1 for record in records if not record.ok)
    return AccuracyReport(since, compare(records, measured.engine, since=since), failed)


@dataclass
class CapacityReport:
    streams: int
    tokens: int
    failed: int
    since_token: Distribution
    since_emitted: Distribution | None

    def lines(self) -> list[str]:
        def show(d: Distribution) -> str:
            return (
                f"median {d.median:.3f} ms, p90 {d.p90:.3f} ms, p99 {d.p99:.3f} ms, "
                f"max {d.max:.3f} ms"
            )

        out = [f"{self.streams} concurrent streams, {self.tokens} tokens, {self.failed} failed"]
        out.append("arrival - engine token time (engine send + kernel + generator): ")
        out[-1] += show(self.since_token)
        if self.since_emitted is not None:
            out.append("arrival - engine socket write (kernel + generator): ")
            out[-1] += show(self.since_emitted)
        return out


def capacity_report(measured: Measured, streams: int) -> CapacityReport:
    result = measured.result
    records = result.records
    since_token = arrival_delays(records, measured.engine, result.wall_offset)
    has_emitted = engine_reports_emission(measured)
    since_emitted = (
        distribution(arrival_delays(records, measured.engine, result.wall_offset, since="emitted"))
        if has_emitted
        else None
    )
    return CapacityReport(
        streams=streams,
        tokens=len(since_token),
        failed=sum(1 for r in records if not r.ok),
        since_token=distribution(since_token),
        since_emitted=since_emitted,
    )
