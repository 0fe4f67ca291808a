"""Check the generator against an engine's own clock. Pure functions, no I/O.

The simulator answers ``GET /sim/requests`` with its per-request timings in epoch seconds.
Two checks use them:

- accuracy: per request, the generator's TTFT and TPOT against the engine's
  (first token - received) and (last token - first token) / (tokens - 1), which must agree
  within 1 ms or 5 %, whichever is larger. The engine's instants are either its modelled
  token times or the moments it wrote each chunk to its socket (``emitted_times``); the
  second leaves out the engine's own lateness in sending, which no client can see;
- capacity: per token, the chunk's arrival at the generator against the engine's token time.
  That delay includes the engine's own sending and the kernel, so it bounds the generator's
  added error from above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadgen.records import RequestRecord

ABSOLUTE_TOLERANCE_MS = 1.0
RELATIVE_TOLERANCE = 0.05


@dataclass(frozen=True)
class EngineTiming:
    """One request as the engine saw it (epoch seconds)."""

    request_id: str
    received_at: float
    first_token_at: float | None
    finished_at: float | None
    token_times: tuple[float, ...]
    prompt_tokens: int
    completion_tokens: int
    # When the engine handed each token's chunk to its socket, if it reports that.
    emitted_times: tuple[float, ...] = ()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EngineTiming:
        return cls(
            request_id=str(raw["request_id"]),
            received_at=float(raw["received_at"]),
            first_token_at=None
            if raw.get("first_token_at") is None
            else float(raw["first_token_at"]),
            finished_at=None if raw.get("finished_at") is None else float(raw["finished_at"]),
            token_times=tuple(float(t) for t in raw.get("token_times") or ()),
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=int(raw.get("completion_tokens") or 0),
            emitted_times=tuple(float(t) for t in raw.get("emitted_times") or ()),
        )

    def times(self, since: str) -> tuple[float, ...]:
        """Token times (``token``: when the engine made them) or socket writes (``emitted``)."""
        if since == "token":
            return self.token_times
        if since == "emitted":
            return self.emitted_times
        raise ValueError(f"since must be token or emitted, got {since!r}")

    def ttft(self, since: str = "token") -> float | None:
        times = self.times(since)
        if not times:
            return None
        return times[0] - self.received_at

    def tpot(self, since: str = "token") -> float | None:
        times = self.times(since)
        if self.completion_tokens < 2 or len(times) < 2:
            return None
        return (times[-1] - times[0]) / (self.completion_tokens - 1)


def parse_engine_requests(document: Mapping[str, Any]) -> dict[str, EngineTiming]:
    """``/sim/requests``'s answer, keyed by request id."""
    timings = (EngineTiming.from_dict(raw) for raw in document.get("requests") or ())
    return {timing.request_id: timing for timing in timings}


def tolerance_ms(engine_ms: float) -> float:
    """1 ms or 5 % of the engine's figure, whichever is larger."""
    return max(ABSOLUTE_TOLERANCE_MS, RELATIVE_TOLERANCE * abs(engine_ms))


@dataclass(frozen=True)
class Agreement:
    """The generator's and the engine's TTFT and TPOT of one request, in milliseconds."""

    request_id: str
    client_ttft_ms: float
    engine_ttft_ms: float
    client_tpot_ms: float | None
    engine_tpot_ms: float | None

    @property
    def ttft_error_ms(self) -> float:
        return self.client_ttft_ms - self.engine_ttft_ms

    @property
    def tpot_error_ms(self) -> float | None:
        if self.client_tpot_ms is None or self.engine_tpot_ms is None:
            return None
        return self.client_tpot_ms - self.engine_tpot_ms

    @property
    def ttft_ok(self) -> bool:
        return abs(self.ttft_error_ms) <= tolerance_ms(self.engine_ttft_ms)

    @property
    def tpot_ok(self) -> bool:
        error = self.tpot_error_ms
        if error is None or self.engine_tpot_ms is None:
            return self.client_tpot_ms is None and self.engine_tpot_ms is None
        return abs(error) <= tolerance_ms(self.engine_tpot_ms)

    @property
    def ok(self) -> bool:
        return self.ttft_ok and self.tpot_ok


class MatchError(ValueError):
    """A generator record has no engine counterpart, or their token counts differ."""


def _engine_of(record: RequestRecord, engine: Mapping[str, EngineTiming]) -> EngineTiming:
    timing = engine.get(record.response_id)
    if timing is None:
        raise MatchError(
            f"request {record.index} ({record.response_id!r}) is unknown to the engine"
        )
    return timing


def compare(
    records: Sequence[RequestRecord], engine: Mapping[str, EngineTiming], *, since: str = "token"
) -> list[Agreement]:
    """Pair every successful record with the engine's timing of the same request.

    ``since`` picks the engine's instants: ``token`` (modelled token times) or ``emitted``
    (when each chunk was written to the socket), see ``EngineTiming.times``.
    """
    out = []
    for record in records:
        if not record.ok:
            continue
        timing = _engine_of(record, engine)
        client_ttft, engine_ttft = record.ttft, timing.ttft(since)
        if client_ttft is None or engine_ttft is None:
            raise MatchError(f"request {record.index} has no first token on one side")
        client_tpot = record.tpot if record.output_tokens > 1 else None
        engine_tpot = timing.tpot(since)
        out.append(
            Agreement(
                record.response_id,
                client_ttft * 1000.0,
                engine_ttft * 1000.0,
                None if client_tpot is None else client_tpot * 1000.0,
                None if engine_tpot is None else engine_tpot * 1000.0,
            )
        )
    return out


def arrival_delays(
    records: Sequence[RequestRecord],
    engine: Mapping[str, EngineTiming],
    wall_offset: float,
    *,
    since: str = "token",
) -> list[float]:
    """Per token: arrival at the generator (epoch) minus the engine's time, in seconds.

    ``since`` is ``token`` (the engine's token time, so the delay includes the engine's own
    sending) or ``emitted`` (when the engine wrote the chunk to its socket, so the delay is
    the kernel's and the generator's alone). ``wall_offset`` turns the generator's
    perf_counter stamps into epoch seconds. The sim sends one chunk per token, so the i-th
    chunk is the i-th token.
    """
    delays: list[float] = []
    for record in records:
        if not record.ok:
            continue
        timing = _engine_of(record, engine)
        reference = timing.times(since)
        if len(record.chunk_times) != len(reference):
            raise MatchError(
                f"request {record.index}: {len(record.chunk_times)} chunks arrived but the "
                f"engine recorded {len(reference)} {since} times"
            )
        delays.extend(
            arrived + wall_offset - made
            for arrived, made in zip(record.chunk_times, reference, strict=True)
        )
    return delays
