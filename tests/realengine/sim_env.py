"""The simulator in the real-engine tier: ``syshax sim`` processes with the interface the tier's
tests use for real vLLM (``EngineProcess``), so the same tests run on both.

Configured like the vLLM pair where the contract allows (served name ``tiny``, the
SyshaxShmConnector's ``--kv-transfer-config``, ``--enable-prompt-tokens-details``); the model
and devices are presets (qwen2.5-7b-instruct, an A100 in the GPU role and the Kunpeng host
in the CPU role). Each engine listens on a fixed port, so a restart after ``kill()`` keeps
the URL the router was given.
"""

from __future__ import annotations

import os
from pathlib import Path

from common.supervisor import python_argv
from testbed.vllm_env import EngineProcess

MODEL = "qwen2.5-7b-instruct"
MAX_MODEL_LEN = 4096
# The timeline 20 times faster than real time: the Kunpeng host decodes the 7B model at
# ~47 ms a token, so ~2.4 ms here: 1,800 tokens take ~4 s, long enough for a policy change
# (the router re-reads its file every 250 ms) to land mid-stream.
SPEED = 20.0


class SimEngine(EngineProcess):
    """One ``syshax sim`` process."""

    what = "simulator"
    poll_interval = 0.1

    def __init__(
        self,
        name: str,
        port: int,
        workdir: Path,
        *,
        device: str,
        kv_transfer_config: str,
        speed: float = SPEED,
    ) -> None:
        argv = python_argv(
            "sim", "--device", device, "--model", MODEL, "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--speed", str(speed),
            "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details",
            "--kv-transfer-config", kv_transfer_config, "--log-level", "INFO",
        )  # fmt: skip
        super().__init__(name, port, workdir, argv, dict(os.environ))
