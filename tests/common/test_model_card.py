"""The model card reader: the context length vLLM would derive, and one clear line for a
directory that cannot be served."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.model_card import ModelCardError, derive_max_model_len, read_model_card


def model_dir(
    tmp_path: Path, config: dict[str, Any], tokenizer: dict[str, Any] | None = None
) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return root


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"}


def test_a_small_llama_reads_its_positions_dtype_and_chat_template(tmp_path: Path) -> None:
    root = model_dir(
        tmp_path,
        {**LLAMA, "max_position_embeddings": 1024},
        {"chat_template": "{{ messages }}", "model_max_length": 1e30},
    )
    card = read_model_card(root)
    assert card.max_model_len == 1024
    assert card.length_key == "max_position_embeddings"
    assert card.dtype == "bfloat16"
    assert card.chat_template is True
    assert card.architectures == ("LlamaForCausalLM",)
    assert card.to_dict()["architectures"] == ["LlamaForCausalLM"]


def test_no_tokenizer_config_means_no_chat_template(tmp_path: Path) -> None:
    card = read_model_card(model_dir(tmp_path, {**LLAMA, "max_position_embeddings": 4096}))
    assert card.chat_template is False and card.max_model_len == 4096


@pytest.mark.parametrize(
    ("config", "tokenizer", "expected"),
    [
        # The smallest length key wins, as in vLLM.
        ({"max_position_embeddings": 8192, "seq_length": 4096}, None, (4096, "seq_length")),
        ({"n_positions": 1024}, None, (1024, "n_positions")),
        # model_max_length in the config wins over the others (Command-R).
        (
            {"max_position_embeddings": 8192, "model_max_length": 131072},
            None,
            (131072, "model_max_length"),
        ),
        # The tokenizer's model_max_length caps it.
        (
            {"max_position_embeddings": 8192},
            {"model_max_length": 2048},
            (2048, "model_max_length (tokenizer_config.json)"),
        ),
        # Linear and dynamic RoPE scaling multiply; llama3 and YaRN are already scaled.
        (
            {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}},
            None,
            (16384, "max_position_embeddings"),
        ),
        (
            {
                "max_position_embeddings": 4096,
                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0},
            },
            None,
            (8192, "max_position_embeddings"),
        ),
        (
            {
                "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
            },
            None,
            (131072, "max_position_embeddings"),
        ),
        (
            {
                "max_position_embeddings": 32768,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            },
            None,
            (32768, "max_position_embeddings"),
        ),
        # Gemma 3's length is already scaled.
        (
            {
                "model_type": "gemma3",
                "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            },
            None,
            (131072, "max_position_embeddings"),
        ),
        # A multimodal config keeps its lengths in text_config.
        (
            {"text_config": {"max_position_embeddings": 32768}},
            None,
            (32768, "max_position_embeddings"),
        ),
        # No key: vLLM assumes 2048 itself; we leave it to vLLM.
        ({}, None, (None, None)),
        # Junk values are ignored, not trusted.
        (
            {"max_position_embeddings": "lots", "n_positions": True, "seq_len": float("nan")},
            None,
            (None, None),
        ),
    ],
)
def test_the_length_follows_vllms_derivation(
    config: dict[str, Any],
    tokenizer: dict[str, Any] | None,
    expected: tuple[int | None, str | None],
) -> None:
    assert derive_max_model_len(config, tokenizer) == expected


def test_a_profile_asking_more_than_the_model_is_refused_naming_field_and_numbers(
    tmp_path: Path,
) -> None:
    card = read_model_card(model_dir(tmp_path, {**LLAMA, "max_position_embeddings": 1024}))
    card.check_max_model_len(1024)
    card.check_max_model_len(None)
    with pytest.raises(ModelCardError) as caught:
        card.check_max_model_len(2048)
    message = str(caught.value)
    assert message.startswith("max_model_len: 2048 is more than the model allows: 1024")
    assert "max_position_embeddings" in message and "\n" not in message


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda root: None, "does not exist"),
        (lambda root: root.write_text("x"), "is not a directory"),
        (lambda root: root.mkdir(), "has no config.json"),
        (
            lambda root: (root.mkdir(), (root / "config.json").write_text("{nope")),
            "not readable JSON",
        ),
        (
            lambda root: (root.mkdir(), (root / "config.json").write_text("[1]")),
            "not a JSON object",
        ),
        (
            lambda root: (root.mkdir(), (root / "config.json").write_text("{}")),
            "names no architectures",
        ),
    ],
)
def test_a_directory_that_cannot_be_served_gives_one_line(
    tmp_path: Path, make: Any, expected: str
) -> None:
    root = tmp_path / "model"
    make(root)
    with pytest.raises(ModelCardError) as caught:
        read_model_card(root)
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)
