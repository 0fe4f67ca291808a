"""The PD wire protocols, one object each, chosen once per deployment (``Deployment.pd``).

A protocol runs a sequence split across a deployment's engines (``run``: GPU prefill, CPU
decode, re-decisions, the move back to the GPU) and continues a passthrough stream whose
engine died on the other one where its engines allow it (``resume``). ``vllm`` is upstream
vLLM V1 with the SyshaxShmConnector (``router.pd_vllm``); ``syshax`` is sysHAX's patched
engines (``router.pd_syshax``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from router.pd_syshax import SyshaxPd
from router.pd_vllm import VllmProtocol

if TYPE_CHECKING:
    from router.backends import Backend
    from router.decide import Decision
    from router.flow import Exchange


class PdProtocol(Protocol):
    name: str

    def unspliceable(self, body: dict[str, Any]) -> str | None:
        """Why this request cannot be split across engines in this protocol, or None."""
        ...

    async def run(self, ex: Exchange, decision: Decision) -> None:
        """Produce the whole answer into ``ex.out`` (its finish reason included)."""
        ...

    async def resume(self, ex: Exchange, failed: Backend, why: str) -> bool:
        """Continue ``ex``'s relayed stream on the other engine; False when it cannot."""
        ...


PROTOCOLS: dict[str, PdProtocol] = {p.name: p for p in (VllmProtocol(), SyshaxPd())}
