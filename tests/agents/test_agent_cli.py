"""`syshax agent` options: flags, the JSON config file, mounts and simulated presets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from agents.cli import add_arguments, build_config
from agents.main import parse_mounts
from common.engine_spec import Mount


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_win_over_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "agent.json"
    config.write_text(
        json.dumps(
            {
                "control_plane": "http://cp:8000",
                "token": "sxa_file",
                "runtime": "docker",
                "simulate_accelerator": ["a100-80gb*2"],
                "heartbeat_interval": 2,
                "name": "gpu-01",
            }
        )
    )
    cfg = build_config(parse("--config", str(config), "--token", "sxa_flag"))
    assert cfg.token == "sxa_flag" and cfg.control_plane == "http://cp:8000"
    assert cfg.runtime == "docker" and cfg.heartbeat_interval == 2.0
    assert cfg.simulate == ["a100-80gb", "a100-80gb"]
    assert cfg.state_dir == Path("var/agent/gpu-01")


def test_missing_token_and_unknown_presets_stop_at_start_up() -> None:
    with pytest.raises(SystemExit, match="--control-plane and --token are required"):
        build_config(parse("--control-plane", "http://cp"))
    with pytest.raises(SystemExit, match="unknown preset 'v100'"):
        build_config(
            parse("--control-plane", "http://cp", "--token", "t", "--simulate-accelerator", "v100")
        )


def test_mounts_default_to_read_only_at_the_same_path() -> None:
    assert parse_mounts(["/models", "/a:/b:rw", "/c:/d"]) == [
        Mount("/models", "/models", True),
        Mount("/a", "/b", False),
        Mount("/c", "/d", True),
    ]
    with pytest.raises(ValueError, match="expected SRC"):
        parse_mounts(["/a:/b:/c"])
