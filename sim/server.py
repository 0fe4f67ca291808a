"""The HTTP face of the simulator: vLLM's OpenAI-compatible routes plus /sim/* introspection."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from common import __version__
from common.files import write_ready_file
from sim import kvshm, responses
from sim.connector import Connector, ConnectorConfig
from sim.engine import EngineConfig, SimEngine
from sim.handoff import Handoff, HandoffPlan
from sim.kvshm import HandoffError
from sim.metrics import MetricsMode, build_registry, render
from sim.prefix_cache import BlockHasher
from sim.protocol import (
    ApiError,
    ParsedRequest,
    check_length,
    check_priority,
    decode_json,
    parse_detokenize,
    parse_request,
    parse_tokenize,
)
from sim.scheduler import FinishReason, Sequence
from sim.tokens import Tokenizer, context_tail
from sim.tracing import engine_tracing

log = logging.getLogger("sim")

VLLM_VERSION = "0.32.0"  # the vLLM whose API and metric names the simulator follows


@dataclass
class ServerSettings:
    host: str
    metrics_mode: MetricsMode
    shm_dir: Path
    kv_lease_seconds: float
    kv_connector: ConnectorConfig | None = None  # --kv-transfer-config (already resolved)
    enable_prompt_tokens_details: bool = False
    log_stats: bool = True  # False (--disable-log-stats): /metrics has no vllm:* families
    # --otlp-traces-endpoint: an llm_request span per request, as vLLM emits (sim/tracing.py)
    otlp_traces_endpoint: str | None = None


class SimServer:
    def __init__(self, engine: SimEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        cfg = engine.config
        self.model_name = cfg.served_model_name
        self.max_model_len = engine.capacity.max_model_len
        self.port_ref = [0]
        self.tokenizer = Tokenizer(cfg.model.vocab_size)
        digest = hashlib.blake2b(f"{cfg.model.name}:{cfg.seed}".encode(), digest_size=4)
        self.fingerprint = f"vllm-{VLLM_VERSION}-{digest.hexdigest()}"
        self.connector: Connector | None = None
        if settings.kv_connector is not None:
            self.connector = Connector(
                engine_id=cfg.engine_id,
                peer_engine_id=settings.kv_connector.peer_engine_id,
                shm_dir=settings.shm_dir,
                lease_seconds=settings.kv_lease_seconds,
                model=cfg.model,
                tensor_parallel_size=cfg.tensor_parallel_size,
                arena_mib=settings.kv_connector.arena_mib,
                slab_kib=settings.kv_connector.slab_kib,
            )
        self.handoff = Handoff(
            shm_dir=settings.shm_dir,
            engine_id=cfg.engine_id,
            model=cfg.model,
            device=cfg.device,
            lease_seconds=settings.kv_lease_seconds,
            connector=self.connector,
            served_model_name=cfg.served_model_name,
        )
        self.registry = build_registry(engine, settings.metrics_mode, settings.log_stats)
        self.tracing = engine_tracing(settings.otlp_traces_endpoint)
        self.created = int(time.time())
        self._reaper: asyncio.Task[None] | None = None
        self.reclaimed = 0

    # -- application ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/sim/requests", self.sim_requests)
        app.router.add_get("/sim/info", self.sim_info)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        self.engine.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _cleanup(self, app: web.Application) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.engine.stop()
        self.tracing.close()

    async def _reap_forever(self) -> None:
        interval = min(5.0, max(0.1, self.settings.kv_lease_seconds / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                for path in kvshm.reap(self.settings.shm_dir):
                    self.reclaimed += 1
                    log.info("reclaimed leaked KV segment %s", path)
                if self.connector is not None:
                    for name in self.connector.reap():
                        self.reclaimed += 1
                        log.info("reclaimed expired KV transfer segment %s", name)
            except OSError as exc:  # keep reaping: leases must not stop with one error
                log.warning("reaping %s failed: %s", self.settings.shm_dir, exc)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except HandoffError as exc:
            err = ApiError(exc.status, exc.message, exc.param, exc.err_type)
            return web.json_response(err.body(), status=exc.status)

    # -- simple routes -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.engine.config.model.hf_id,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=render(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.model_name}.",
                "model",
            )

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: the ids a completion or chat request with this prompt or
        these messages would run on (the same tokenizer and chat template)."""
        req = parse_tokenize(decode_json(await request.read()), self.tokenizer)
        self._check_model(req.model)
        strs = [self.tokenizer.token_text(t) for t in req.token_ids]
        return web.json_response(
            {
                "count": len(req.token_ids),
                "max_model_len": self.max_model_len,
                "tokens": req.token_ids,
                "token_strs": strs if req.return_token_strs else None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        model, token_ids = parse_detokenize(decode_json(await request.read()))
        self._check_model(model)
        return web.json_response({"prompt": self.tokenizer.decode(token_ids)})

    async def sim_requests(self, request: web.Request) -> web.Response:
        items = self.engine.ring.snapshot()
        since = request.query.get("since")
        if since is not None:
            try:
                cutoff = float(since)
            except ValueError:
                raise ApiError(400, "since must be epoch seconds", "since") from None
            items = [r for r in items if r["received_at"] >= cutoff]
        limit = request.query.get("limit")
        if limit is not None:
            if not limit.isdigit():
                raise ApiError(400, "limit must be a non-negative integer", "limit")
            items = items[len(items) - int(limit) :] if int(limit) else []
        unpacked = [
            {
                **r,
                "token_times": r["token_times"].tolist(),
                "emitted_times": r["emitted_times"].tolist(),
            }
            for r in items
        ]
        return web.json_response(
            {
                "engine_id": self.engine.config.engine_id,
                "speed": self.engine.speed,
                "requests": unpacked,
            }
        )

    async def sim_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.config
        sched = self.engine.scheduler
        return web.json_response(
            {
                "simulator_version": __version__,
                "engine_id": cfg.engine_id,
                "role": "cpu" if cfg.device.is_cpu else "gpu",
                "device": cfg.device.name,
                "device_kind": cfg.device.kind,
                "model": cfg.model.name,
                "served_model_name": cfg.served_model_name,
                "speed": cfg.speed,
                "seed": cfg.seed,
                "max_model_len": self.max_model_len,
                "cores": cfg.device.cores,
                "numa_nodes": cfg.device.numa_nodes,
                "effective_flops": self.engine.hw.flops,
                "effective_bandwidth": self.engine.hw.bandwidth,
                "max_num_seqs": cfg.max_num_seqs,
                "num_kv_blocks": sched.config.num_blocks,
                "block_size": cfg.block_size,
                "kv_bytes_per_token": cfg.model.kv_bytes_per_token,
                "shm_dir": str(self.settings.shm_dir),
                "kv_lease_seconds": self.settings.kv_lease_seconds,
                "kv_connector": self.connector.describe() if self.connector else None,
                "syshax_compat": cfg.syshax_compat,
                "scheduling_policy": cfg.scheduling_policy,
                "enable_prompt_tokens_details": self.settings.enable_prompt_tokens_details,
                "segments_reclaimed": self.reclaimed,
                "late_steps": self.engine.late_steps,
                "kv_events": self.engine.kv_publisher.describe()
                if self.engine.kv_publisher
                else None,
                # "device" above is the preset's name (kept as it was), hence another key.
                "device_usage": self.engine.device_usage(),
            }
        )

    # -- generation ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(
        self, request: web.Request, kind: Literal["chat", "completion"]
    ) -> web.StreamResponse:
        compat = self.engine.config.syshax_compat
        body = decode_json(await request.read())
        req = parse_request(kind, body, self.tokenizer, syshax_compat=compat)
        self._check_model(req.model)
        check_priority(req, self.engine.config.scheduling_policy)
        max_new = check_length(req, self.max_model_len)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        response_id = req.syshax.request_id_inference or f"{prefix}{uuid.uuid4().hex[:16]}"
        params = req.kv_transfer_params
        if self.connector is not None and isinstance(params, dict) and "transfer_id" in params:
            # The prefill's answer may come before its copy lands: wait for the segment.
            await self.connector.wait_published(params, req.prompt_tokens)
        plan = self.handoff.prepare(req, response_id)
        seq = self._sequence(req, response_id, max_new, plan)
        fmt = responses.StreamFormat(
            kind=kind,
            rid=seq.request_id,
            created=int(time.time()),
            model=self.model_name,
            fingerprint=self.fingerprint,
            return_token_ids=req.return_token_ids,
            include_usage=req.include_usage,
            prompt_ids=req.prompt_ids,
        )
        if req.stream:
            try:
                return await self._stream(request, req, seq, plan, fmt)
            finally:
                self.tracing.finished(request.headers, seq, body, self.engine.epoch_of)
        sink = responses.CollectSink(request.transport)
        seq.sink = sink
        self.engine.submit(seq)
        await sink.done
        self.tracing.finished(request.headers, seq, body, self.engine.epoch_of)
        reason, kv_params = await self._after(seq, plan)
        usage = responses.usage(
            kind, req.prompt_tokens, seq.generated, self._cached(plan, seq), stream=False
        )
        return web.json_response(
            responses.full_response(fmt, sink.token_ids, reason, usage, kv_params)
        )

    def _cached(self, plan: HandoffPlan, seq: Sequence) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens``: local prefix-cache hits + KV the
        connector loaded, or what the prefill reported."""
        if not self.settings.enable_prompt_tokens_details:
            return None
        if plan.cached_override is not None:
            return plan.cached_override
        return seq.cache_hits + seq.connector_hits

    def _sequence(
        self, req: ParsedRequest, response_id: str, max_new: int, plan: HandoffPlan
    ) -> Sequence:
        context = req.prompt_ids + req.resumed_ids
        return Sequence(
            request_id=response_id,
            prompt_tokens=req.prompt_tokens,
            resumed_tokens=req.resumed_tokens,
            max_new_tokens=max_new,
            tail=context_tail(context),
            hasher=BlockHasher(
                context,
                self.engine.config.block_size,
                keep_tokens=self.engine.kv_publisher is not None,
            )
            if self.engine.config.enable_prefix_caching
            else None,
            new_token_limit=plan.new_token_limit,
            natural_stop=req.max_tokens is None and not req.ignore_eos,
            min_tokens=req.min_tokens,
            priority=req.priority,
            imported_tokens=plan.imported_tokens,
            connector_queried=plan.connector_queried,
            connector_hits=plan.connector_hits,
            ready_at=self.engine.sim_now(),
            load_seconds=plan.import_seconds,
            export_stall_seconds=self.handoff.export_stall_seconds(req.prompt_tokens)
            if plan.connector_prefill
            else 0.0,
        )

    async def _after(self, seq: Sequence, plan: HandoffPlan) -> tuple[str, dict[str, Any] | None]:
        """Publish the KV a finished request leaves behind; returns (finish reason, the
        answer's kv_transfer_params)."""
        reason = seq.finish_reason or FinishReason.ABORT
        if reason == FinishReason.ABORT:
            return reason.value, None
        speed = self.engine.speed
        if reason == FinishReason.SCHEDULED and plan.sequence_id is not None:
            tokens = seq.computed
            await asyncio.sleep(self.handoff.export_seconds(tokens) / speed)
            self.handoff.publish_syshax(plan.sequence_id, tokens)
            return reason.value, None
        if plan.connector_prefill and reason != FinishReason.STOP:
            # Stopped by itself: nothing is left to decode, so nothing is published. The
            # answer goes at once; the segment is published when its copy has landed.
            tokens = seq.prompt_tokens + seq.resumed_tokens
            params = self.handoff.publish_connector(tokens, plan.prompt_digest)
            if "transfer_id" in params and self.connector is not None:
                asyncio.get_running_loop().call_later(
                    self.handoff.export_seconds(tokens) / speed, self.connector.land, params
                )
            return reason.value, params
        if plan.connector_error is not None:
            return reason.value, {"syshax_kv_error": plan.connector_error}
        return reason.value, None

    async def _stream(
        self,
        request: web.Request,
        req: ParsedRequest,
        seq: Sequence,
        plan: HandoffPlan,
        fmt: responses.StreamFormat,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
            }
        )
        resp.enable_chunked_encoding()
        # A StreamResponse sends its headers in prepare(), so from here on the engine can
        # write token chunks straight to the transport. Completions have no role chunk.
        await resp.prepare(request)
        if req.kind == "chat":
            await resp.write(fmt.role_chunk())
        defer = plan.sequence_id is not None
        sink = responses.StreamSink(request.transport, fmt, defer_scheduled=defer)
        seq.sink = sink
        self.engine.submit(seq)
        await sink.done
        if seq.finish_reason == FinishReason.ABORT:
            return resp
        # The connector's kv_transfer_params are not streamed (vLLM puts them only in a
        # non-streaming answer); a streamed prefill still publishes, for its lease.
        reason, _ = await self._after(seq, plan)
        try:
            if defer and reason == FinishReason.SCHEDULED:
                await resp.write(fmt.finish_chunk(reason))
            if req.include_usage:
                await resp.write(
                    fmt.usage_chunk(req.prompt_tokens, seq.generated, self._cached(plan, seq))
                )
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass  # the client left after its last token
        return resp


async def serve(
    config: EngineConfig, settings: ServerSettings, port: int, ready_file: Path | None
) -> None:
    """Run one engine until SIGINT/SIGTERM. ``port`` 0 binds a free port (see ``ready_file``)."""
    engine = SimEngine(config)
    server = SimServer(engine, settings)
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    host = settings.host
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = int(sock.getsockname()[1])
    server.port_ref[0] = bound
    await web.SockSite(runner, sock).start()
    cap = engine.capacity
    log.info(
        "engine %s: %s on %s, %d KV blocks (%.1f GiB), max_model_len %d, speed %gx, "
        "listening on http://%s:%d",
        config.engine_id,
        config.model.name,
        config.device.name,
        cap.num_blocks,
        cap.kv_bytes / 2**30,
        cap.max_model_len,
        engine.speed,
        host,
        bound,
    )
    if ready_file is not None:
        write_ready_file(ready_file, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
