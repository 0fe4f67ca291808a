"""What a request does with KV from elsewhere, in the two prefill->decode protocols.

vLLM 0.32 with the SyshaxShmConnector (``--kv-transfer-config``; ``connector.py``): a
request with ``kv_transfer_params.do_remote_decode`` publishes its prompt's KV when it ends
(unless it stopped by itself: nothing is left to decode) and answers the transfer's params;
one whose params carry a ``transfer_id`` loads that KV, or, when the transfer is unusable,
logs why at ERROR and recomputes, as vLLM does. Whatever the connector, a
``remote_prefill_cached_tokens`` integer in ``do_remote_prefill`` params becomes the request's
cached-token count (vLLM's output processor does that).

sysHAX style (``--syshax-compat`` only): ``num_decode_tokens`` limits how many tokens a
request generates (0 = prefill only: one token), a chunk that stops on that limit ends
``finish_reason: "scheduled"`` and publishes its KV under the sequence id;
``request_id_inference`` + ``generated_text`` on a later request maps it back. Without
``request_id_inference`` a ``generated_text`` request recomputes the KV by prefilling prompt
+ generated text (how a sequence returns to the GPU). Segments: ``kvshm.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.presets import DevicePreset, ModelPreset
from kvconnector.syshax_kv_shm import prompt_digest
from sim import kvshm
from sim.connector import Connector, SegmentError
from sim.perfmodel import kv_copy_time
from sim.protocol import ApiError, ParsedRequest

log = logging.getLogger("sim")


@dataclass
class HandoffPlan:
    imported_tokens: int = 0  # KV tokens mapped from shared memory
    import_seconds: float = 0.0  # the connector's load of those tokens (holds a step)
    new_token_limit: int | None = None
    sequence_id: str | None = None  # sysHAX: the id to publish under when "scheduled"
    connector_prefill: bool = False  # publish the prompt's KV through the connector at the end
    connector_queried: bool = False
    connector_hits: int = 0
    connector_error: str | None = None  # why a transfer was not used (answered to the client)
    cached_override: int | None = None  # remote_prefill_cached_tokens
    # The prompt's digest for the transfer a connector prefill publishes (the connector's
    # ``prompt_digest``: the served model, no adapter, the prompt's token ids).
    prompt_digest: str | None = None


class Handoff:
    def __init__(
        self,
        *,
        shm_dir: Path,
        engine_id: str,
        model: ModelPreset,
        device: DevicePreset,
        lease_seconds: float,
        connector: Connector | None,
        served_model_name: str = "",
    ) -> None:
        self.shm_dir = shm_dir
        self.engine_id = engine_id
        self.model = model
        self.device = device
        self.lease_seconds = lease_seconds
        self.connector = connector
        self.served_model_name = served_model_name

    def prepare(self, req: ParsedRequest, response_id: str) -> HandoffPlan:
        """Validate the handoff fields and load any KV the request refers to."""
        plan = HandoffPlan()
        params = req.kv_transfer_params or {}
        cached = params.get("remote_prefill_cached_tokens")
        if params.get("do_remote_prefill") and isinstance(cached, int):
            plan.cached_override = cached
        if self.connector is not None:
            self._connector_plan(plan, params, req, response_id)
        self._syshax_plan(plan, req, response_id)
        if plan.imported_tokens:
            plan.import_seconds = kv_copy_time(
                self.model, plan.imported_tokens, self.device.kv_import_bandwidth
            )
        return plan

    def _connector_plan(
        self, plan: HandoffPlan, params: dict[str, Any], req: ParsedRequest, response_id: str
    ) -> None:
        assert self.connector is not None
        plan.connector_queried = True
        if params.get("do_remote_decode"):
            plan.connector_prefill = True
            plan.prompt_digest = prompt_digest(req.prompt_ids, self.served_model_name, None)
            return
        if "transfer_id" not in params:
            return
        try:
            tokens = self.connector.load(params, req.prompt_tokens)
        except SegmentError as exc:
            log.error(
                "SyshaxShmConnector %s: request %s recomputes its prompt, transfer %s unusable: %s",
                self.connector.engine_id,
                response_id,
                params.get("transfer_id"),
                exc,
            )
            plan.connector_error = str(exc)
            return
        plan.imported_tokens = plan.connector_hits = tokens

    def _syshax_plan(self, plan: HandoffPlan, req: ParsedRequest, response_id: str) -> None:
        fields = req.syshax
        if fields.num_decode_tokens is not None:
            plan.new_token_limit = max(1, fields.num_decode_tokens)
            plan.sequence_id = response_id
        if fields.request_id_inference is None:
            return
        rid = kvshm.check_id(fields.request_id_inference, "request_id_inference")
        if req.resumed_tokens < 1:
            raise ApiError(
                400,
                "generated_text must hold the text generated so far (at least the first "
                "token the prefill returned)",
                "generated_text",
            )
        # The KV covers everything but the last sampled token, whose KV the next step makes.
        context = req.prompt_tokens + req.resumed_tokens
        plan.imported_tokens = kvshm.open_segment(
            self.shm_dir,
            rid,
            param="request_id_inference",
            model=self.model.name,
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            expected_tokens=context - 1,
        ).tokens
        plan.sequence_id = rid

    def export_seconds(self, tokens: int) -> float:
        """From the end of the prefill's step until its KV is published."""
        return kv_copy_time(self.model, tokens, self.device.kv_export_bandwidth)

    def export_stall_seconds(self, tokens: int) -> float:
        """What saving ``tokens`` tokens of KV adds to the step that completes the prompt."""
        return self.device.kv_export_stall * self.export_seconds(tokens)

    def publish_syshax(self, sequence_id: str, tokens: int) -> Path:
        seg = kvshm.publish(
            self.shm_dir,
            sequence_id,
            request_id=sequence_id,
            engine_id=self.engine_id,
            model=self.model.name,
            tokens=tokens,
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            lease_seconds=self.lease_seconds,
        )
        return seg.path

    def publish_connector(self, prompt_tokens: int, digest: str | None = None) -> dict[str, Any]:
        """The prompt's KV through the connector; its ``kv_transfer_params`` as vLLM
        answers them (the scheduler adds the prefill's local prefix-cache hits: none here),
        bound to the prompt by ``digest`` as the connector binds them."""
        assert self.connector is not None
        params = self.connector.publish(prompt_tokens)
        if "transfer_id" in params:
            if digest is not None:
                params["prompt_digest"] = digest
            params["remote_prefill_cached_tokens"] = 0
        return params
