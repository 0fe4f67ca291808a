"""The PD wire protocols, one object each, looked up by a deployment's ``pd_protocol``.

A protocol runs a sequence split across a deployment's engines (``run``: GPU prefill, CPU
decode, re-decisions, the move back to the GPU) and continues a passthrough stream whose
engine died on the other one where its engines allow it (``resume``). ``vllm`` is upstream
vLLM V1 with the SyshaxShmConnector (``router.pd.vllm``); ``syshax`` is sysHAX's patched
engines (``router.pd.syshax``).
"""

from __future__ import annotations

from typing import Any, Protocol

from router.decide import Decision
from router.engines.backends import Backend
from router.pd.sequence import PdSequence
from router.pd.syshax import SyshaxPd
from router.pd.vllm import VllmProtocol


class PdProtocol(Protocol):
    name: str

    def unspliceable(self, body: dict[str, Any]) -> str | None:
        """Why this request cannot be split across engines in this protocol, or None."""
        ...

    async def run(self, seq: PdSequence, decision: Decision) -> None:
        """Produce the whole answer into ``seq.out`` (its finish reason included)."""
        ...

    async def resume(self, seq: PdSequence, failed: Backend, why: str) -> bool:
        """Continue ``seq``'s relayed stream on the other engine; False when it cannot."""
        ...


PROTOCOLS: dict[str, PdProtocol] = {p.name: p for p in (VllmProtocol(), SyshaxPd())}
