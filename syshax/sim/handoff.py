"""The two prefill->decode wire protocols on top of the shared-memory segments.

sysHAX style: ``num_decode_tokens`` limits how many tokens a request generates (0 = prefill
only: one token), a chunk that stops on that limit ends ``finish_reason: "scheduled"`` and
publishes its KV under the sequence id; ``request_id_inference`` + ``generated_text`` on a
later request maps it back. Without ``request_id_inference`` a ``generated_text`` request
recomputes the KV by prefilling prompt + generated text (how a sequence returns to the GPU).

Upstream vLLM style (NixlConnector's fields): a prefill carries
``kv_transfer_params.do_remote_decode`` and answers with ``kv_transfer_params`` for the decode
side; the decode sends the original request plus those parameters. The segment key is the
first remote block id, which is unique across engines because each engine numbers its blocks
from a random 40-bit base.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syshax.sim import kvshm
from syshax.sim.kvshm import HandoffError
from syshax.sim.perfmodel import kv_copy_time
from syshax.sim.presets import DevicePreset, ModelPreset
from syshax.sim.protocol import ApiError, ParsedRequest


@dataclass
class HandoffPlan:
    imported_tokens: int = 0  # KV tokens mapped from shared memory
    import_seconds: float = 0.0  # modelled copy cost of those tokens (sim seconds)
    new_token_limit: int | None = None
    sequence_id: str | None = None  # sysHAX: the id to publish under when "scheduled"
    vllm_prefill: bool = False


@dataclass
class Published:
    path: Path
    kv_transfer_params: dict[str, Any] | None


class Handoff:
    def __init__(
        self,
        *,
        shm_dir: Path,
        engine_id: str,
        served_model_name: str,
        model: ModelPreset,
        device: DevicePreset,
        lease_seconds: float,
        block_size: int,
        host: str,
        port_ref: list[int],
        tensor_parallel_size: int,
        seed: int,
    ) -> None:
        self.shm_dir = shm_dir
        self.engine_id = engine_id
        self.served_model_name = served_model_name
        self.model = model
        self.device = device
        self.lease_seconds = lease_seconds
        self.block_size = block_size
        self.host = host
        self.port_ref = port_ref  # filled in once the server is bound (port 0)
        self.tp = tensor_parallel_size
        self._next_block = random.Random(f"{seed}:{engine_id}").randrange(1 << 40)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _import(self, key: str, param: str, expected_tokens: int, engine: str | None) -> int:
        seg = kvshm.open_segment(
            self.shm_dir,
            key,
            param=param,
            model=self.model.name,
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            expected_tokens=expected_tokens,
            expected_engine_id=engine,
        )
        return seg.tokens

    def prepare(self, req: ParsedRequest, response_id: str) -> HandoffPlan:
        """Validate the handoff fields and claim any KV segment the request refers to."""
        context = req.prompt_tokens + req.resumed_tokens
        plan = HandoffPlan()
        params = req.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            engine, block_ids = self._vllm_fields(params)
            tokens = self._import(f"b{block_ids[0]}", "kv_transfer_params", context, engine)
            if len(block_ids) != self.blocks_for(tokens):
                raise HandoffError(
                    409,
                    f"remote_block_ids lists {len(block_ids)} blocks but the KV segment holds "
                    f"{tokens} tokens = {self.blocks_for(tokens)} blocks of {self.block_size}",
                    "kv_transfer_params",
                    "ConflictError",
                )
            # Re-run the last prompt token to sample, as a decode instance does.
            plan.imported_tokens = context - 1
        elif params.get("do_remote_decode"):
            plan.vllm_prefill = True
        if req.num_decode_tokens is not None:
            plan.new_token_limit = max(1, req.num_decode_tokens)
            plan.sequence_id = response_id
        if req.request_id_inference is not None:
            rid = kvshm.check_id(req.request_id_inference, "request_id_inference")
            if req.resumed_tokens < 1:
                raise ApiError(
                    400,
                    "generated_text must hold the text generated so far (at least the first "
                    "token the prefill returned)",
                    "generated_text",
                )
            # The KV covers everything but the last sampled token, whose KV the next step makes.
            plan.imported_tokens = self._import(rid, "request_id_inference", context - 1, None)
            plan.sequence_id = rid
        if plan.imported_tokens:
            plan.import_seconds = kv_copy_time(
                self.model, plan.imported_tokens, self.device.kv_import_bandwidth
            )
        return plan

    @staticmethod
    def _vllm_fields(params: dict[str, Any]) -> tuple[str, list[int]]:
        engine = params.get("remote_engine_id")
        blocks = params.get("remote_block_ids")
        if not isinstance(engine, str) or not engine:
            raise ApiError(
                400,
                "kv_transfer_params.remote_engine_id must be a non-empty string",
                "kv_transfer_params",
            )
        if (
            not isinstance(blocks, list)
            or not blocks
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)
        ):
            raise ApiError(
                400,
                "kv_transfer_params.remote_block_ids must be a non-empty list of integers",
                "kv_transfer_params",
            )
        return engine, blocks

    def export_seconds(self, tokens: int) -> float:
        return kv_copy_time(self.model, tokens, self.device.kv_export_bandwidth)

    def publish_syshax(self, sequence_id: str, tokens: int) -> Published:
        seg = self._publish(sequence_id, sequence_id, tokens)
        return Published(seg.path, None)

    def publish_vllm(self, request_id: str, tokens: int) -> Published:
        count = self.blocks_for(tokens)
        first = self._next_block
        self._next_block += count
        seg = self._publish(f"b{first}", request_id, tokens)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(range(first, first + count)),
            "remote_host": self.host,
            "remote_port": self.port_ref[0],
            "remote_request_id": request_id,
            "tp_size": self.tp,
        }
        return Published(seg.path, params)

    def _publish(self, key: str, request_id: str, tokens: int) -> kvshm.Segment:
        return kvshm.publish(
            self.shm_dir,
            key,
            request_id=request_id,
            engine_id=self.engine_id,
            model=self.model.name,
            tokens=tokens,
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            lease_seconds=self.lease_seconds,
        )
