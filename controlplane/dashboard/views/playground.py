"""The playground on a deployment's page: one chat to the deployment's model through a
configured router, forced to GPU-only, PD or auto, with the route and reason the router
answered with and the TTFT and tokens/s the control plane measured on the stream
(docs/dashboard.md).

The router is one the operator configured (``ROUTER_URLS``; one whose registered router is
alive first), never an address a router only reported (``controlplane.routers.destinations``):
the operator's prompt and the routers' benchmark key go there, so it may force the mode with
``X-Syshax-Mode``. The stream is read by the load generator's timed
client (``loadgen.wire``): every read is stamped as it arrives.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from common.decisions import Mode
from common.sse import DONE_DATA, event_data, split_events
from controlplane.dashboard.views.common import require_perm
from controlplane.deployments.models import Deployment
from controlplane.routers import destinations
from controlplane.routers.destinations import Destination
from loadgen.client import DECISION_HEADER, FORCED_MODE_HEADER, api_root
from loadgen.wire import ConnectionPool, WireError, post

# The router's header naming why it chose the route (router/client/stream.py).
REASON_HEADER = "X-Syshax-Reason"
# The modes the playground offers: the X-Syshax-Mode values, with their labels.
MODES = (
    (Mode.AUTO.value, "auto (the policy decides)"),
    (Mode.GPU_ONLY.value, "GPU only"),
    (Mode.FORCED_PD.value, "PD"),
)
TIMEOUT_S = 120.0
_TEXT_LIMIT = 500


class PlaygroundForm(forms.Form):
    prefix = "play"  # its fields stay apart from the page's other forms
    prompt = forms.CharField(max_length=4000, widget=forms.Textarea(attrs={"rows": 3}))
    max_tokens = forms.IntegerField(label="Max tokens", min_value=1, max_value=1024, initial=64)
    mode = forms.ChoiceField(choices=MODES, initial=Mode.AUTO.value)


@dataclass
class Answer:
    """What the playground shows of one chat."""

    ok: bool = False
    router: str = ""
    mode: str = ""
    status: int | None = None
    route: str = ""
    reason: str = ""
    text: str = ""
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tokens_per_second: float | None = None
    error: str = ""
    errors: dict[str, list[str]] = field(default_factory=dict)


def live_router() -> Destination | None:
    """The configured router the playground sends to, or None when ``ROUTER_URLS`` is empty."""
    return destinations.pick()


def _error_message(body: bytes, status: int) -> str:
    """The router's OpenAI error message, else the start of its answer."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:_TEXT_LIMIT]
    text = body.decode(errors="replace").strip()[:_TEXT_LIMIT]
    return f"HTTP {status}" + (f": {text}" if text else "")


def read_stream(pieces: list[tuple[float, bytes]], sent_at: float, answer: Answer) -> None:
    """The answer's text, token count and timings from the stamped SSE reads."""
    buffer = bytearray()
    texts: list[str] = []
    stamps: list[float] = []
    usage: int | None = None
    done = False
    for index, (arrived, data) in enumerate(pieces):
        buffer += data
        final = index == len(pieces) - 1
        for event in split_events(buffer, final=final):
            payload = event_data(event)
            if not payload or done:
                continue
            if payload == DONE_DATA:
                done = True
                continue
            try:
                message = json.loads(payload)
            except ValueError:
                answer.error = "the router sent an unreadable event"
                continue
            if not isinstance(message, dict):
                continue
            if error := message.get("error"):
                detail = error.get("message", "") if isinstance(error, dict) else str(error)
                answer.error = str(detail)[:_TEXT_LIMIT] or "the stream ended with an error"
                continue
            for choice in message.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    texts.append(content)
                    stamps.append(arrived)
            if isinstance(message.get("usage"), dict):
                tokens = message["usage"].get("completion_tokens")
                usage = tokens if isinstance(tokens, int) else usage
    answer.text = "".join(texts)
    answer.completion_tokens = usage if usage is not None else len(stamps)
    if stamps:
        answer.ttft_ms = round(1000.0 * (stamps[0] - sent_at), 1)
        tokens = answer.completion_tokens or len(stamps)
        elapsed = stamps[-1] - sent_at
        if elapsed > 0:
            answer.tokens_per_second = round(tokens / elapsed, 1)
        if tokens > 1 and stamps[-1] > stamps[0]:
            answer.tpot_ms = round(1000.0 * (stamps[-1] - stamps[0]) / (tokens - 1), 2)
    elif not answer.error:
        answer.error = "the stream ended without any text"
    answer.ok = not answer.error


async def chat(url: str, key: str, model: str, prompt: str, max_tokens: int, mode: str) -> Answer:
    """Send one streamed chat to the router at ``url`` and time it."""
    answer = Answer(mode=mode)
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    headers = {"Content-Type": "application/json", FORCED_MODE_HEADER: mode}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    pool = ConnectionPool(connect_timeout_s=5.0)
    try:
        sent_at = time.perf_counter()  # the clock loadgen.wire stamps its reads with
        response = await post(pool, f"{api_root(url)}/chat/completions", body, headers, TIMEOUT_S)
    except (WireError, OSError, TimeoutError, ValueError) as exc:
        answer.error = f"could not reach the router: {type(exc).__name__}: {exc}".strip()[
            :_TEXT_LIMIT
        ]
        return answer
    finally:
        pool.close()
    answer.status = response.head.status
    answer.route = response.head.headers.get(DECISION_HEADER.lower(), "")
    answer.reason = response.head.headers.get(REASON_HEADER.lower(), "")
    if answer.status != 200:
        raw = b"".join(piece for _, piece in response.pieces)
        answer.error = _error_message(raw, answer.status)
        return answer
    read_stream(response.pieces, sent_at, answer)
    if not answer.error and response.error:
        answer.error = response.error[:_TEXT_LIMIT]
        answer.ok = False
    return answer


def run_chat(deployment: Deployment, data: dict[str, Any]) -> Answer:
    router = live_router()
    if router is None:
        return Answer(
            mode=data["mode"],
            error="no router configured: list the routers in ROUTER_URLS",
        )
    answer = asyncio.run(
        chat(
            router.url,
            destinations.router_key_for(router.url),
            deployment.profile.model_name_for_clients,
            data["prompt"],
            data["max_tokens"],
            data["mode"],
        )
    )
    answer.router = router.name
    return answer


@require_POST
@require_perm("deployments.change_deployment")
def playground(request: HttpRequest, pk: int) -> HttpResponse:
    """Send the form's chat and answer in JSON (the page's script shows it); a form sent
    without the script gets the answer as a message on the deployment's page."""
    deployment = get_object_or_404(Deployment.objects.select_related("profile"), pk=pk)
    form = PlaygroundForm(request.POST)
    wants_json = "application/json" in request.headers.get("Accept", "")
    if not form.is_valid():
        errors = {name: [str(e) for e in errs] for name, errs in form.errors.items()}
        answer = Answer(error="check the fields", errors=errors)
        if wants_json:
            return JsonResponse(asdict(answer), status=400)
        for name, errs in errors.items():
            messages.error(request, f"playground: {name}: {' '.join(errs)}")
        return redirect("dashboard:deployment", pk=pk)
    answer = run_chat(deployment, form.cleaned_data)
    if wants_json:
        return JsonResponse(asdict(answer), status=200 if answer.ok else 502)
    if answer.ok:
        messages.success(request, f"playground: {summary(answer)}: {answer.text}")
    else:
        messages.error(request, f"playground: {answer.error}")
    return redirect("dashboard:deployment", pk=pk)


def summary(answer: Answer) -> str:
    """One line of the answer's route, reason and timings."""
    parts = [f"route {answer.route or '?'}"]
    if answer.reason:
        parts[0] += f" ({answer.reason})"
    if answer.ttft_ms is not None:
        parts.append(f"TTFT {answer.ttft_ms:g} ms")
    if answer.tokens_per_second is not None:
        parts.append(f"{answer.tokens_per_second:g} tokens/s")
    return ", ".join(parts)
