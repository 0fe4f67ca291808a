"""What the load generator records about one request.

Times are ``time.perf_counter()`` seconds of the generator's process, so only differences
between them mean anything; ``wall_offset`` in a run's result turns them into epoch seconds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace


@dataclass
class RequestRecord:
    """One request: when it was sent, when each token chunk arrived, and how it ended.

    A failed request keeps its error and whatever timings it reached; it is counted, never
    dropped.
    """

    index: int
    prompt_tokens: int
    max_tokens: int
    sent_at: float = 0.0
    # Open loop: when the arrival process had it due. A generator whose event loop is busy
    # sends late (``send_lateness``), offering less load than asked and measuring from the
    # late send; None in a closed loop, where nothing is due before the previous answer.
    due_at: float | None = None
    # Arrival time of every SSE chunk that carried generated text, in order.
    chunk_times: list[float] = field(default_factory=list)
    # Tokens the server reported in its usage chunk; None when it sent none.
    usage_output_tokens: int | None = None
    ok: bool = False
    error: str = ""
    status: int = 0
    response_id: str = ""
    # The router's routing decision for this request, when it reports one in a header.
    decision: str = ""
    # And its reason code, when it reports one (``X-Syshax-Reason``).
    reason: str = ""

    @property
    def output_tokens(self) -> int:
        """Generated tokens: the server's usage count, else one per content chunk."""
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        """Send to the first chunk with content, in seconds."""
        if not self.chunk_times:
            return None
        return self.chunk_times[0] - self.sent_at

    @property
    def send_lateness(self) -> float | None:
        """Seconds the request was sent after it was due (open loop), else None."""
        if self.due_at is None:
            return None
        return max(0.0, self.sent_at - self.due_at)

    @property
    def latency(self) -> float | None:
        """End-to-end: send to the last chunk with content, in seconds (vLLM's E2EL)."""
        if not self.chunk_times:
            return None
        return self.chunk_times[-1] - self.sent_at

    @property
    def itl(self) -> list[float]:
        """The gaps between consecutive content chunks, in seconds."""
        times = self.chunk_times
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1); 0 for a one-token answer, as vLLM does."""
        ttft, latency = self.ttft, self.latency
        if ttft is None or latency is None:
            return None
        if self.output_tokens < 2:
            return 0.0
        return (latency - ttft) / (self.output_tokens - 1)

    def scaled(self, factor: float) -> RequestRecord:
        """A copy whose durations since the send are ``factor`` times longer."""
        sent = self.sent_at
        return replace(
            self,
            chunk_times=[sent + (time - sent) * factor for time in self.chunk_times],
        )

    def sample(self) -> dict[str, object]:
        """A compact per-request row for JSON output (milliseconds)."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000.0, 4)

        return {
            "index": self.index,
            "ok": self.ok,
            "error": self.error,
            "status": self.status,
            "response_id": self.response_id,
            "decision": self.decision,
            "reason": self.reason,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": ms(self.ttft),
            "tpot_ms": ms(self.tpot),
            "e2e_ms": ms(self.latency),
        }
