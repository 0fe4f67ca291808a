"""A profile is checked against its model's own limits (common/model_card.py) when the
model directory is one the control plane can read: a context longer than the model's, or a
directory that is no model, is refused by the API with one line naming the field, before any
engine starts. An empty max_model_len leaves the length to the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controlplane.deployments.models import DeploymentProfile
from controlplane.deployments.specs import engine_args

pytestmark = pytest.mark.django_db


def small_llama(root: Path, positions: int = 1024) -> Path:
    root.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": positions}
    (root / "config.json").write_text(json.dumps(config))
    return root


def post(client: Any, **fields: Any) -> Any:
    body = {"name": "p", "engine": "vllm", **fields}
    return client.post("/api/v1/profiles/", body, format="json")


def test_a_context_longer_than_the_models_is_refused_naming_both_numbers(
    admin_client: Any, tmp_path: Path
) -> None:
    model = small_llama(tmp_path / "small")
    response = post(admin_client, model=str(model), max_model_len=2048)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        f"max_model_len: 2048 is more than the model allows: 1024 "
        f"(max_position_embeddings in {model}/config.json)"
    )
    assert not DeploymentProfile.objects.exists()
    assert post(admin_client, model=str(model), max_model_len=1024).status_code == 201


def test_a_directory_without_config_json_is_refused_on_the_model_field(
    admin_client: Any, tmp_path: Path
) -> None:
    response = post(admin_client, model=str(tmp_path), max_model_len=512)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"model: {tmp_path} has no config.json"


def test_a_path_not_on_this_host_and_a_hub_id_are_left_to_the_nodes(admin_client: Any) -> None:
    # The agent checks a node's own directory before it starts an engine (tests/agents).
    assert post(admin_client, model="/models/on-the-node-only").status_code == 201
    response = post(admin_client, name="hub", model="meta-llama/Llama-3.1-8B", max_model_len=8192)
    assert response.status_code == 201


def test_an_empty_max_model_len_leaves_the_length_to_the_engine(
    admin_client: Any, tmp_path: Path
) -> None:
    model = small_llama(tmp_path / "small", positions=32768)
    response = post(admin_client, model=str(model), max_model_len=None)
    assert response.status_code == 201, response.json()
    profile = DeploymentProfile.objects.get(name="p")
    assert profile.max_model_len is None
    args = engine_args(profile, "gpu", engine_id="gpu", peer_engine_id="cpu")
    assert "--max-model-len" not in args
    profile.max_model_len = 4096
    assert engine_args(profile, "gpu")[args.index("--served-model-name") + 2 :][:2] == [
        "--max-model-len",
        "4096",
    ]
