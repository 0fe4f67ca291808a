"""Parsing and validating OpenAI/vLLM request bodies into one plain description.

Follows vLLM 0.32's OpenAI server: fields are coerced the way its pydantic models coerce
them ("5" is a fine max_tokens, "yes" a fine stream), unknown fields are ignored, and errors
carry its two shapes: a pydantic validation error (``type: "Bad Request"``, ``param:
"body.<field>"``) or a request check (``type: "BadRequestError"``, ``param: <field>``, the
message ending ``(parameter=..., value=...)``). ``ApiError`` is the error; the server turns
it into a response.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from sim.tokens import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
_MISSING = object()
_BOOL_WORDS = {
    "0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
    "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True,
}  # fmt: skip


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or {
            400: "BadRequestError",
            404: "NotFoundError",
            409: "ConflictError",
            410: "GoneError",
        }.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class SyshaxFields:
    """sysHAX's request fields (``--syshax-compat`` only)."""

    num_decode_tokens: int | None = None
    request_id_inference: str | None = None
    generated_text: str | None = None


@dataclass
class ParsedRequest:
    kind: Literal["chat", "completion"]
    model: str | None
    prompt_ids: list[int]
    max_tokens: int | None  # None: up to max_model_len
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    kv_transfer_params: dict[str, Any] | None
    max_tokens_param: str = "max_tokens"  # or max_completion_tokens, for error messages
    min_tokens: int = 0
    priority: int = 0  # vLLM's field: lower first under --scheduling-policy priority
    syshax: SyshaxFields = field(default_factory=SyshaxFields)
    resumed_ids: list[int] = field(default_factory=list)  # sysHAX: generated_text's ids

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def resumed_tokens(self) -> int:
        return len(self.resumed_ids)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


class ValidationFailure(ApiError):
    """pydantic's validation errors, as vLLM's server reports them: the first one's ``loc``
    is the ``param``."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        label = "error" if len(errors) == 1 else "errors"
        lines = "".join(f"\n  {e}" for e in errors)
        super().__init__(
            400, f"{len(errors)} validation {label}:{lines}", errors[0]["loc"], "Bad Request"
        )
        self.errors = errors


def validation_error(kind: str, loc: str, msg: str, value: Any, **ctx: Any) -> ValidationFailure:
    """One pydantic validation error."""
    error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": _describe(value)}
    if ctx:
        error["ctx"] = ctx
    return ValidationFailure([error])


def request_error(message: str, param: str | None, value: Any = _MISSING) -> ApiError:
    """A request check of vLLM's (VLLMValidationError)."""
    if param is None:
        return ApiError(400, message, None)
    detail = f"parameter={param}" if value is _MISSING else f"parameter={param}, value={value}"
    return ApiError(400, f"{message} ({detail})", param)


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    loc = f"body.{name}"
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise validation_error(
            "int_from_float",
            loc,
            "Input should be a valid integer, got a number with a fractional part",
            value,
        )
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise validation_error(
                "int_parsing",
                loc,
                "Input should be a valid integer, unable to parse string as an integer",
                value,
            ) from None
    raise validation_error("int_type", loc, "Input should be a valid integer", value)


def _float(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool | int | float):
        return float(value)
    loc = f"body.{name}"
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise validation_error(
                "float_parsing",
                loc,
                "Input should be a valid number, unable to parse string as a number",
                value,
            ) from None
    raise validation_error("float_type", loc, "Input should be a valid number", value)


def _bool(body: dict[str, Any], name: str, loc: str | None = None) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    loc = loc or f"body.{name}"
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.strip().lower()]
    if isinstance(value, int | float | str):
        raise validation_error(
            "bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value
        )
    raise validation_error("bool_type", loc, "Input should be a valid boolean", value)


def _str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None or isinstance(value, str):
        return value
    raise validation_error("string_type", f"body.{name}", "Input should be a valid string", value)


def _dict(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None or isinstance(value, dict):
        return value
    raise validation_error("dict_type", f"body.{name}", "Input should be a valid dictionary", value)


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise validation_error(
            "json_invalid", "body", "JSON decode error", {}, error=str(exc)
        ) from None
    except json.JSONDecodeError as exc:
        raise validation_error(
            "json_invalid", f"body.{exc.pos}", "JSON decode error", {}, error=exc.msg
        ) from None
    if not isinstance(body, dict):
        raise validation_error(
            "model_attributes_type",
            "body",
            "Input should be a valid dictionary or object to extract fields from",
            body,
        )
    return body


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    loc = f"body.messages.{index}.content"
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise validation_error("model_type", loc, "Input should be a text part", part)
            parts.append(part.get("text", ""))
        return " ".join(parts)
    raise validation_error("string_type", loc, "Input should be a valid string", content)


def _chat_prompt(
    body: dict[str, Any],
    tokenizer: Tokenizer,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise validation_error("missing", "body.messages", "Field required", body)
    if not isinstance(messages, list):
        raise validation_error(
            "list_type", "body.messages", "Input should be a valid list", messages
        )
    if not messages:
        raise request_error("messages must be a non-empty list", "messages")
    pairs = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise validation_error("missing", f"body.messages.{i}.role", "Field required", msg)
        pairs.append((msg["role"], _content_text(msg.get("content"), i)))
    return tokenizer.encode_chat(
        pairs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )


def _token_ids(prompt: list[Any], tokenizer: Tokenizer) -> list[int]:
    for i, token in enumerate(prompt):
        if not isinstance(token, int) or isinstance(token, bool):
            raise validation_error(
                "int_type", f"body.prompt.{i}", "Input should be a valid integer", token
            )
        if token < 0:
            raise validation_error(
                "greater_than_equal",
                f"body.prompt.{i}",
                "Input should be greater than or equal to 0",
                token,
                ge=0,
            )
        if token >= tokenizer.vocab_size:
            raise request_error(f"Token id {token} is out of vocabulary", None)
    return list(prompt)


def _completion_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    empty = request_error(
        "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
    )
    if prompt is None or prompt == "":
        raise empty
    if isinstance(prompt, list) and not prompt:
        raise request_error("You must pass at least one prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
        if not ids:
            raise empty
        return ids
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        # vLLM serves a batch of prompts as one response with n choices; this engine does not.
        raise request_error("this engine serves one prompt per request", "prompt")
    if isinstance(prompt, list):
        return _token_ids(prompt, tokenizer)
    raise validation_error("string_type", "body.prompt", "Input should be a valid string", prompt)


def _max_tokens(kind: str, body: dict[str, Any]) -> tuple[int | None, str]:
    """(the requested output limit, the field that gave it); checked in ``check_length``."""
    if kind == "chat":
        value = _int(body, "max_completion_tokens")
        if value is not None:
            return value, "max_completion_tokens"
        return _int(body, "max_tokens"), "max_tokens"
    if "max_tokens" in body:
        return _int(body, "max_tokens"), "max_tokens"  # an explicit null: up to max_model_len
    return COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens"


def _syshax_fields(body: dict[str, Any], tokenizer: Tokenizer) -> tuple[SyshaxFields, list[int]]:
    num_decode = _int(body, "num_decode_tokens")
    if num_decode is not None and num_decode < 0:
        raise ApiError(
            400, f"num_decode_tokens must be >= 0, got {num_decode}", "num_decode_tokens"
        )
    rid = _str(body, "request_id_inference")
    generated = _str(body, "generated_text")
    if rid is not None and generated is None:
        raise ApiError(
            400,
            "a decode request with request_id_inference needs generated_text "
            "(all text generated so far)",
            "generated_text",
        )
    if rid is not None and num_decode is None:
        raise ApiError(
            400,
            "a decode request with request_id_inference needs num_decode_tokens",
            "num_decode_tokens",
        )
    fields = SyshaxFields(num_decode, rid, generated)
    return fields, tokenizer.encode(generated) if generated else []


def parse_request(
    kind: Literal["chat", "completion"],
    body: dict[str, Any],
    tokenizer: Tokenizer,
    *,
    syshax_compat: bool = False,
) -> ParsedRequest:
    """The request as the engine runs it. sysHAX's fields count only with ``syshax_compat``;
    otherwise they are unknown fields, ignored as vLLM ignores them."""
    model = _str(body, "model")
    if kind == "chat":
        prompt_ids = _chat_prompt(body, tokenizer)
    else:
        prompt_ids = _completion_prompt(body, tokenizer)
    max_tokens, max_tokens_param = _max_tokens(kind, body)
    for name in (
        "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
    ):  # fmt: skip
        _float(body, name)
    _int(body, "seed")
    priority = _int(body, "priority") or 0
    n = _int(body, "n")
    if n is not None and n != 1:
        raise request_error("this engine supports n=1 only", "n", n)
    min_tokens = _int(body, "min_tokens") or 0
    if min_tokens < 0:
        raise request_error(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
            "min_tokens",
            min_tokens,
        )
    options = _dict(body, "stream_options") or {}
    include_usage = _bool(options, "include_usage", "body.stream_options.include_usage")
    syshax, resumed = _syshax_fields(body, tokenizer) if syshax_compat else (SyshaxFields(), [])
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        stream=bool(_bool(body, "stream")),
        include_usage=bool(include_usage),
        ignore_eos=bool(_bool(body, "ignore_eos")),
        return_token_ids=bool(_bool(body, "return_token_ids")),
        kv_transfer_params=_dict(body, "kv_transfer_params"),
        min_tokens=min_tokens,
        priority=priority,
        syshax=syshax,
        resumed_ids=resumed,
    )


def check_priority(req: ParsedRequest, scheduling_policy: str) -> None:
    """vLLM refuses a non-zero ``priority`` unless it schedules by priority."""
    if req.priority != 0 and scheduling_policy != "priority":
        raise ApiError(400, f"Got priority {req.priority} but Priority scheduling is not enabled.")


def check_length(req: ParsedRequest, max_model_len: int) -> int:
    """The number of new tokens this request may generate; ApiError where vLLM refuses.

    vLLM's order: an output limit above max_model_len is refused, then a prompt longer than
    max_model_len; a limit the prompt leaves no room for is clamped to what fits, and only a
    result below 1 is refused."""
    limit = req.max_tokens
    if limit is not None and limit > max_model_len:
        param = req.max_tokens_param
        raise request_error(
            f"{param}={limit} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
            limit,
        )
    context = req.prompt_tokens + req.resumed_tokens
    if context > max_model_len:
        raise request_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {context} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            context,
        )
    room = max_model_len - context
    new_tokens = room if limit is None else min(room, limit)
    if new_tokens < 1:
        raise request_error(
            f"max_tokens must be at least 1, got {new_tokens}.", "max_tokens", new_tokens
        )
    return new_tokens


# -- /tokenize and /detokenize ---------------------------------------------------------------


@dataclass
class TokenizeRequest:
    model: str | None
    token_ids: list[int]
    return_token_strs: bool


def _tokenize_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> TokenizeRequest:
    """vLLM's ``TokenizeCompletionRequest``. ``add_special_tokens`` is type-checked only:
    this tokenizer has no BOS token to add."""
    prompt = body.get("prompt")
    if prompt is None:
        raise validation_error("missing", "body.prompt", "Field required", body)
    if not isinstance(prompt, str):
        raise validation_error(
            "string_type", "body.prompt", "Input should be a valid string", prompt
        )
    _bool(body, "add_special_tokens")
    strs = _bool(body, "return_token_strs")
    return TokenizeRequest(_str(body, "model"), tokenizer.encode(prompt), bool(strs))


def _tokenize_messages(body: dict[str, Any], tokenizer: Tokenizer) -> TokenizeRequest:
    """vLLM's ``TokenizeChatRequest``."""
    messages = body.get("messages")
    if messages is None:
        raise validation_error("missing", "body.messages", "Field required", body)
    if not isinstance(messages, list):
        raise validation_error(
            "list_type", "body.messages", "Input should be a valid list", messages
        )
    generation = _bool(body, "add_generation_prompt")
    open_last = _bool(body, "continue_final_message")
    _bool(body, "add_special_tokens")
    strs = _bool(body, "return_token_strs")
    if generation and open_last:
        raise request_error(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None
        )
    if not messages:
        raise request_error(
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
            None,
        )
    ids = _chat_prompt(
        body,
        tokenizer,
        add_generation_prompt=generation is not False and not open_last,
        continue_final_message=bool(open_last),
    )
    return TokenizeRequest(_str(body, "model"), ids, bool(strs))


def parse_tokenize(body: dict[str, Any], tokenizer: Tokenizer) -> TokenizeRequest:
    """A ``/tokenize`` body: vLLM's union of a completion form (``prompt``) and a chat form
    (``messages``), tried in that order as pydantic tries them; when neither validates, the
    errors of both, the completion form's first."""
    try:
        return _tokenize_prompt(body, tokenizer)
    except ValidationFailure as completion:
        try:
            return _tokenize_messages(body, tokenizer)
        except ValidationFailure as chat:
            raise ValidationFailure(completion.errors + chat.errors) from None


# The largest token id vLLM's DetokenizeRequest accepts (an int64).
MAX_TOKEN_ID = 2**63 - 1


def parse_detokenize(body: dict[str, Any]) -> tuple[str | None, list[int]]:
    """vLLM's ``DetokenizeRequest``: (model, token ids). An id past the vocabulary is not an
    error: it decodes to nothing, as vLLM's tokenizer decodes it."""
    model = _str(body, "model")
    tokens = body.get("tokens")
    if tokens is None:
        raise validation_error("missing", "body.tokens", "Field required", body)
    if not isinstance(tokens, list):
        raise validation_error("list_type", "body.tokens", "Input should be a valid list", tokens)
    ids = []
    for i, token in enumerate(tokens):
        loc = f"body.tokens.{i}"
        value = _int({f"tokens.{i}": token}, f"tokens.{i}")
        if value is None:
            raise validation_error("int_type", loc, "Input should be a valid integer", token)
        if value < 0:
            raise validation_error(
                "greater_than_equal", loc, "Input should be greater than or equal to 0", token, ge=0
            )
        if value > MAX_TOKEN_ID:
            raise validation_error(
                "less_than_equal",
                loc,
                f"Input should be less than or equal to {MAX_TOKEN_ID}",
                token,
                le=MAX_TOKEN_ID,
            )
        ids.append(value)
    return model, ids
