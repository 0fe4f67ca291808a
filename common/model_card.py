"""What a model directory says about itself: architecture, context length, dtype, chat template.

Read from the directory's own ``config.json`` (and ``tokenizer_config.json``) with the standard
library alone, so the agent, ``syshax up`` and the control plane can check a profile against the
model before any engine starts. The context length follows the rules vLLM 0.32 applies when it
derives ``max_model_len`` (``vllm/config/model.py``, ``_get_and_verify_max_len``):

- the smallest of the length keys the config has (``max_position_embeddings``, ``n_positions``,
  ``max_seq_len``, ``seq_length``, ``max_sequence_length``, ``max_seq_length``, ``seq_len``,
  ``max_target_positions``), where ``model_max_length`` in the config, when set, wins;
- capped by the tokenizer's ``model_max_length``;
- multiplied by the RoPE scaling factor, except for the RoPE types whose positions are already
  scaled (``su``, ``longrope``, ``llama3``, YaRN and its DeepSeek variants) and for Gemma 3.

A config with none of the keys gives ``max_model_len`` None: vLLM then assumes 2,048 and says
so in its log; we leave the choice to it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length.
PRESCALED_ROPE = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)
# A config.json or tokenizer_config.json larger than this is not a model's config.
MAX_CONFIG_BYTES = 4 * 1024 * 1024


class ModelCardError(ValueError):
    """A model directory that cannot be served, in one line: ``field: reason``, where the
    field is the name the caller gave the setting (``model``, ``--model``, ``max_model_len``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class ModelCard:
    path: str
    architectures: tuple[str, ...]
    model_type: str
    max_model_len: int | None  # None: the config names no length, vLLM assumes 2048
    length_key: str | None  # the key the length came from, as vLLM names it in its error
    dtype: str | None
    chat_template: bool

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["architectures"] = list(self.architectures)
        return out

    def check_max_model_len(self, wanted: int | None, field: str = "max_model_len") -> None:
        """Refuse a context longer than the model's, naming the field and both numbers."""
        if wanted is None or self.max_model_len is None or wanted <= self.max_model_len:
            return
        raise ModelCardError(
            field,
            f"{wanted} is more than the model allows: {self.max_model_len} "
            f"({self.length_key} in {self.path}/config.json)",
        )


def _read_json(path: Path, field: str) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ModelCardError(field, f"{path}: {size} bytes, more than a model config can be")
        data = json.loads(path.read_text(encoding="utf-8"))
    except ModelCardError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelCardError(field, f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelCardError(field, f"{path}: not a JSON object")
    return data


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _rope_parameters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """RoPE settings as transformers writes them: ``rope_parameters`` (v5, possibly one per
    layer type) or ``rope_scaling`` (v4)."""
    found: list[dict[str, Any]] = []
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if not isinstance(value, dict):
            continue
        if all(isinstance(v, dict) for v in value.values()) and value:
            found.extend(value.values())  # per layer type
        else:
            found.append(value)
        break
    return found


def derive_max_model_len(
    config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None
) -> tuple[int | None, str | None]:
    """The context length vLLM derives from a config, and the key it came from."""
    text = config.get("text_config")
    source = text if isinstance(text, dict) else config
    length: float | None = None
    key: str | None = None
    for name in LENGTH_KEYS:
        value = _number(source.get(name))
        if value is not None and (length is None or value < length):
            length, key = value, name
    if (value := _number(source.get("model_max_length"))) is not None:
        length, key = value, "model_max_length"
    tokenizer_limit = _number((tokenizer_config or {}).get("model_max_length"))
    if tokenizer_limit is not None and (length is None or tokenizer_limit < length):
        length, key = tokenizer_limit, "model_max_length (tokenizer_config.json)"
    if length is None:
        return None, None
    if "gemma3" not in str(source.get("model_type") or config.get("model_type") or ""):
        factor = 1.0
        for rope in _rope_parameters(source):
            kind = rope.get("rope_type", rope.get("type"))
            if kind not in PRESCALED_ROPE and (scale := _number(rope.get("factor"))):
                factor = scale
        length *= factor
    return int(length), key


def read_model_card(path: str | Path, field: str = "model") -> ModelCard:
    """The card of the model in directory ``path``; :class:`ModelCardError` names what is
    missing or wrong, under ``field`` (the name the caller gives the model setting)."""
    root = Path(path)
    if not root.exists():
        raise ModelCardError(field, f"{root} does not exist")
    if not root.is_dir():
        raise ModelCardError(field, f"{root} is not a directory")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ModelCardError(field, f"{root} has no config.json")
    config = _read_json(config_path, field)
    architectures = config.get("architectures")
    if (
        not isinstance(architectures, list)
        or not architectures
        or not all(isinstance(a, str) and a for a in architectures)
    ):
        raise ModelCardError(field, f"{config_path} names no architectures")
    tokenizer_path = root / "tokenizer_config.json"
    tokenizer = _read_json(tokenizer_path, field) if tokenizer_path.is_file() else {}
    length, key = derive_max_model_len(config, tokenizer)
    dtype = config.get("torch_dtype") or config.get("dtype")
    chat = bool(tokenizer.get("chat_template")) or (root / "chat_template.jinja").is_file()
    return ModelCard(
        path=str(root.resolve()),
        architectures=tuple(architectures),
        model_type=str(config.get("model_type") or ""),
        max_model_len=length,
        length_key=key,
        dtype=dtype if isinstance(dtype, str) else None,
        chat_template=chat,
    )
