"""The vLLM CPU engine image (images/vllm-cpu/), built or found by scripts/dev/vllm_image.sh.

The script runs scripts/dev/compose_setup.sh first (Podman, its private storage, the Debian base
image), so the image lives beside the compose test's images and is rebuilt only when its
inputs change. :func:`ensure_vllm_image` skips only where Podman cannot be installed and skips
are allowed, like the compose test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "dev" / "vllm_image.sh"


def ensure_vllm_image() -> dict[str, str]:
    """compose_setup.sh's settings (CONTAINERS_CONF, SYSHAX_BASE_IMAGE, ...) plus
    VLLM_CPU_IMAGE, VLLM_CPU_IMAGE_STATE (cached or built) and VLLM_CPU_IMAGE_SECONDS."""
    skips_forbidden = os.environ.get("SYSHAX_FORBID_SKIPS") == "1"
    if shutil.which("apt-get") is None:
        missing = "no apt-get: Podman cannot be installed here"
        if skips_forbidden:
            pytest.fail(missing)
        pytest.skip(missing)
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=2400, env=os.environ
    )
    if done.returncode == 3 and not skips_forbidden:
        pytest.skip(f"Podman cannot be installed here: {done.stderr.strip()[-500:]}")
    assert done.returncode == 0, f"vllm_image.sh failed:\n{done.stdout}\n{done.stderr}"
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    print(
        f"[vllm-containers] image {found['VLLM_CPU_IMAGE']} {found['VLLM_CPU_IMAGE_STATE']} "
        f"in {time.monotonic() - started:.1f}s "
        f"({int(found['VLLM_CPU_IMAGE_BYTES']) / 1e9:.2f} GB)",
        flush=True,
    )
    return found
