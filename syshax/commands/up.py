"""``syshax up``: the whole system on this machine, on the embedded defaults.

In order: migrations and an admin user; the web app, the machine gateway in front of it
(the agent's and the router's endpoint), a Celery worker and beat; one node agent with the
process runtime, this host's real CPU topology and a simulated A100 80GB; the default hetero
deployment of simulated engines (GPU first, then CPU); a router on 7010.
Ctrl-C stops the deployment through the workflow, then every process, and leaves none
behind. Running it again reuses the state under var/.
"""

# lazy imports: a verb loads Django and the parts it drives only when it runs, after the
# settings are chosen, so every other verb starts fast and never needs a database.

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import httpx

from common.model_card import ModelCardError, read_model_card
from common.supervisor import Supervisor, python_argv, wait_until

# How often ``syshax up`` polls while it waits for a child or the deployment.
POLL_S = 0.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="dashboard/API port")
    parser.add_argument(
        "--gateway-port",
        type=int,
        default=8010,
        help="the machine gateway's port, which the agent and the router use",
    )
    parser.add_argument("--router-port", type=int, default=7010)
    parser.add_argument("--gpu-port", type=int, default=7001, help="simulated GPU engine port")
    parser.add_argument("--cpu-port", type=int, default=7002, help="simulated CPU engine port")
    parser.add_argument(
        "--no-engines",
        action="store_true",
        help="only the control plane, worker and beat (no agent, engines, router)",
    )
    parser.add_argument(
        "--benchmark",
        action="store_true",
        help="run MISSION.md's short scenario in cpu, gpu and hetero mode",
    )
    parser.add_argument("--benchmark-iterations", type=int, default=32)
    parser.add_argument(
        "--exit",
        action="store_true",
        help="serve one completion through the router, then stop everything",
    )
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    engines = parser.add_argument_group("engines")
    engines.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="sim: simulated engines (default); vllm: two real vLLM engines of --model",
    )
    engines.add_argument("--model", help="--engine vllm: the model directory (or hub id)")
    engines.add_argument(
        "--max-model-len",
        type=int,
        help="--engine vllm: the context length the engines serve (default: the model's own, "
        "from its config.json, as vLLM derives it)",
    )
    engines.add_argument(
        "--engine-python",
        default=sys.executable,
        help="--engine vllm: an interpreter that has vLLM (default: this one); it needs "
        "nothing of syshax, the agent puts the KV connector on its PYTHONPATH",
    )


class Stack:
    def __init__(self, args: argparse.Namespace, var_dir: Path) -> None:
        self.args = args
        self.var_dir = var_dir
        self.sup = Supervisor(var_dir / "logs")
        self.base = f"http://{args.host}:{args.port}"
        # The machines' endpoint (syshax gateway), in front of web (docs/scale.md).
        self.gateway = f"http://{args.host}:{args.gateway_port}"
        self.router = f"http://{args.host}:{args.router_port}"
        self.deployment_id: int | None = None
        self.agent_state = var_dir / "agent"
        self.model_name = served_model_name(args)
        # The agent runs an engine's interpreter only if it is told of it, and compares paths.
        python = args.engine_python
        self.engine_python = os.path.abspath(python) if os.sep in python else python
        # The router's API key (var/up/tokens.json); new: made by this run, so shown once.
        self.router_api_key = ""
        self.router_api_key_new = False
        # The key that may force a policy mode (X-Syshax-Mode): the benchmark's and smoke_pd's.
        self.router_benchmark_key = ""

    def router_headers(self, key: str = "") -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.router_api_key}"}

    def say(self, text: str) -> None:
        print(text, flush=True)

    def alive(self) -> None:
        dead = self.sup.first_exited()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited:\n{self.sup.tail(dead)}")

    def wait_http(self, url: str, what: str) -> None:
        def answers() -> bool:
            try:
                return httpx.get(url, timeout=2).status_code < 500
            except httpx.HTTPError:
                return False

        wait_until(answers, self.args.startup_timeout, what, interval=POLL_S, alive=self.alive)

    def child_env(self) -> dict[str, str]:
        # Children find the console script next to this interpreter.
        bin_dir = str(Path(sys.executable).parent)
        return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def start_control_plane(self) -> None:
        # The control plane sends router keys and prompts only to the routers it is told of
        # (docs/decisions/0056-router-destinations-configured.md): the one started here.
        env = {**self.child_env(), "ROUTER_URLS": self.router}
        # The benchmark worker sends the router's key with the runs it executes, the batch
        # worker with each line, and web with the playground's chat.
        key = {"ROUTER_API_KEY": self.router_api_key} if self.router_api_key else {}
        if self.router_benchmark_key:
            key["ROUTER_BENCHMARK_KEY"] = self.router_benchmark_key
        self.sup.start(
            "web",
            python_argv("web", "--bind", f"{self.args.host}:{self.args.port}", "--no-migrate"),
            {**env, **key},
        )
        gateway = f"{self.args.host}:{self.args.gateway_port}"
        self.sup.start(
            "gateway", python_argv("gateway", "--bind", gateway, "--upstream", self.base), env
        )
        self.sup.start("worker", python_argv("worker", "--concurrency", "2"), env)
        self.sup.start(
            "benchmarks",
            python_argv("worker", "--queues", "benchmarks", "--concurrency", "1"),
            {**env, **key},
        )
        # The Batch API's worker sends each line through the router as its tenant, with the
        # router's key (docs/batches.md).
        self.sup.start(
            "batches",
            python_argv("worker", "--queues", "batches", "--concurrency", "1"),
            {**env, **key},
        )
        self.sup.start("beat", python_argv("beat"), env)
        self.wait_http(f"{self.base}/api/v1/health", "the web app")
        self.wait_http(f"{self.gateway}/api/v1/health", "the machine gateway")

    def start_engines_and_router(self) -> None:
        from syshax.commands import up_stack

        node = up_stack.local_node_name()
        tokens = up_stack.ensure_tokens(self.var_dir, node)
        env = self.child_env()
        self.sup.start(
            "agent",
            python_argv(
                "agent",
                "--control-plane",
                self.gateway,
                "--name",
                node,
                "--runtime",
                "process",
                "--simulate-accelerator",
                "a100-80gb",
                "--state-dir",
                str(self.agent_state),
                "--address",
                "127.0.0.1",
                *(["--engine-python", self.engine_python] if self.args.engine == "vllm" else []),
            ),
            # Tokens travel in the environment: a command line is readable by every local user.
            {**env, "SYSHAX_AGENT_TOKEN": tokens["agent"]},
        )
        wait_until(
            lambda: up_stack.node_ready(node),
            self.args.startup_timeout,
            f"node {node} to report its hardware",
            interval=POLL_S,
            alive=self.alive,
        )
        self.say(f"node       {node}: online (host CPUs, simulated A100 80GB)")
        if self.args.engine == "vllm":
            self.deployment_id = up_stack.ensure_vllm_deployment(
                node,
                self.args.gpu_port,
                self.args.cpu_port,
                model=self.args.model,
                served=self.model_name,
                python=self.engine_python,
                max_model_len=self.args.max_model_len,
            )
            self.say(f"engines    real vLLM ({self.args.engine_python}), model {self.args.model}")
            if context := getattr(self.args, "context", None):
                source = "" if self.args.max_model_len else " (the model's own)"
                self.say(f"           context {context:,} tokens{source}")
            if not Path("/dev/nvidia0").exists():
                self.say(
                    "           no NVIDIA GPU here: both engines run on the CPU (vLLM's CPU "
                    "backend); the GPU role's card is simulated"
                )
        else:
            self.deployment_id = up_stack.ensure_deployment(
                node, self.args.gpu_port, self.args.cpu_port
            )
        up_stack.deploy(self.deployment_id)
        self.say("deploying  GPU engine, then CPU engine in its IPC namespace:")
        timeline = up_stack.Timeline(self.deployment_id, self.say)

        def settled() -> str | None:
            state = timeline.poll()
            return state if state in ("running", "failed") else None

        state = wait_until(
            settled, self.args.startup_timeout, "the deployment", interval=POLL_S, alive=self.alive
        )
        if state != "running":
            raise RuntimeError(
                f"deployment failed: {up_stack.deployment_state(self.deployment_id)[1]}"
            )
        self.sup.start(
            "router",
            python_argv(
                "router",
                "--control-plane",
                self.gateway,
                "--name",
                "local-router",
                "--host",
                self.args.host,
                "--port",
                str(self.args.router_port),
                "--state-dir",
                str(self.var_dir / "router"),
            ),
            {
                **env,
                "SYSHAX_ROUTER_TOKEN": tokens["router"],
                "SYSHAX_ROUTER_API_KEY": self.router_api_key,
                "SYSHAX_ROUTER_BENCHMARK_KEY": self.router_benchmark_key,
            },
        )
        self.wait_for_model()

    def wait_for_model(self) -> None:
        def listed() -> bool:
            try:
                body = httpx.get(
                    f"{self.router}/v1/models", headers=self.router_headers(), timeout=2
                ).json()
            except (httpx.HTTPError, ValueError):
                return False
            return any(m.get("id") == self.model_name for m in body.get("data", []))

        wait_until(
            listed,
            self.args.startup_timeout,
            "the router to serve the model",
            interval=POLL_S,
            alive=self.alive,
        )

    def smoke(self) -> None:
        request = {
            "model": self.model_name,
            "prompt": "Explain prefill and decode.",
            "max_tokens": 16,
        }
        refused = httpx.post(f"{self.router}/v1/completions", timeout=30, json=request)
        if refused.status_code != 401:
            raise RuntimeError(
                f"the router answered {refused.status_code} to a request without its API key"
            )
        self.say("router refuses a request without its API key (401)")
        response = httpx.post(
            f"{self.router}/v1/completions",
            timeout=120,
            headers=self.router_headers(),
            json=request,
        )
        response.raise_for_status()
        body = response.json()
        self.say(
            f"completion through the router: {body['choices'][0]['text'].strip()[:60]!r} "
            f"({body['usage']['completion_tokens']} tokens)"
        )
        if self.args.engine == "vllm":
            self.smoke_pd()

    def smoke_pd(self) -> None:
        """One answer forced through PD (GPU prefill, KV through the connector, CPU decode)
        beside the GPU-only answer: at temperature 0 they are the same tokens."""
        texts = {}
        for mode in ("forced-pd", "gpu-only"):
            response = httpx.post(
                f"{self.router}/v1/completions",
                timeout=300,
                headers={**self.router_headers(self.router_benchmark_key), "X-Syshax-Mode": mode},
                json={
                    "model": self.model_name,
                    "prompt": "Explain prefill and decode.",
                    "max_tokens": 32,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            response.raise_for_status()
            texts[mode] = (response.headers.get("X-Syshax-Route"), response.json())
        (pd_route, pd), (_, gpu) = texts["forced-pd"], texts["gpu-only"]
        same = pd["choices"][0].get("token_ids") == gpu["choices"][0].get("token_ids")
        kv = [
            line.split(" ")[0].split('"')[1] + "=" + line.rsplit(" ", 1)[1]
            for line in httpx.get(f"{self.router}/metrics", timeout=10).text.splitlines()
            if line.startswith("syshax_router_kv_transfers_total{")
        ]
        self.say(
            f"PD through the router (route {pd_route}): the answer equals the GPU-only answer "
            f"token for token: {'yes' if same else 'NO'}; KV handoffs: {', '.join(kv) or 'none'}"
        )

    def benchmark(self) -> int:
        """MISSION.md's short scenario in CPU, GPU and hetero mode, through the router and the
        control plane (so the node's resource use during each row is reported too)."""
        import subprocess

        from syshax.commands.up_stack import LOCAL_DEPLOYMENT, admin_api_token

        argv = python_argv(
            "benchmark",
            "--scenario",
            "short",
            "--concurrency",
            "8",
            "--iterations",
            str(self.args.benchmark_iterations),
            "--mode",
            "all",
            "--deployment",
            LOCAL_DEPLOYMENT,
            "--control-plane",
            self.base,
            "--json",
            str(self.var_dir / "up" / "benchmark-short.json"),
        )
        env = {
            **os.environ,
            **self.child_env(),
            "SYSHAX_TOKEN": admin_api_token(self.var_dir),
            "SYSHAX_ROUTER_API_KEY": self.router_api_key,
            "SYSHAX_ROUTER_BENCHMARK_KEY": self.router_benchmark_key,
        }
        return subprocess.run(argv, env=env).returncode

    def banner(self, password: str | None) -> None:
        model = self.model_name
        self.say(f"dashboard  {self.base}/")
        self.say(f"admin      {self.base}/admin/")
        self.say(f"API        {self.base}/api/v1/  (OpenAPI UI: {self.base}/api/v1/docs/)")
        self.say(f"machines   {self.gateway}/api/v1/  (the gateway the agent and router use)")
        if password:
            self.say(f"admin user admin / {password}   (shown once; change it in the admin)")
        if self.deployment_id is not None:
            self.say(f"router     {self.router}/v1  (OpenAI-compatible; needs its API key)")
            store = self.var_dir / "up" / "tokens.json"
            if self.router_api_key_new:
                self.say(f"router key {self.router_api_key}   (shown once; kept in {store})")
                export = self.router_api_key
            else:  # read from the store, so the key is printed only at the first start
                path = json.dumps(str(store))
                code = f'import json; print(json.load(open({path}))["router_api_key"])'
                export = f"$(python3 -c {shlex.quote(code)})"
            body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 32})
            self.say(
                f"\ntry it:\n  export SYSHAX_ROUTER_API_KEY={export}\n  curl "
                f"{self.router}/v1/completions -H 'Content-Type: application/json' "
                f'-H "Authorization: Bearer $SYSHAX_ROUTER_API_KEY" -d {shlex.quote(body)}'
            )
            self.say(
                "  python -c \"import os; from openai import OpenAI; c = OpenAI(base_url='"
                f"{self.router}/v1', api_key=os.environ['SYSHAX_ROUTER_API_KEY']); print("
                f"c.completions.create(model='{model}', prompt='Hello', max_tokens=32)"
                '.choices[0].text)"'
            )
        self.say(f"logs       {self.sup.log_dir}/")

    def shutdown(self) -> None:
        from syshax.commands import up_stack

        self.say("stopping...")
        if self.deployment_id is not None and self.sup.first_exited() is None:
            try:
                up_stack.stop(self.deployment_id)
                wait_until(
                    lambda: (
                        up_stack.deployment_state(self.deployment_id or 0)[0]
                        in ("stopped", "failed")
                    ),
                    60,
                    "the engines to stop",
                    interval=POLL_S,
                )
            except Exception as exc:
                self.say(f"  could not stop the deployment cleanly: {exc}")
        self.sup.stop_all()
        kill_recorded_engines(self.agent_state)
        self.say("stopped.")


def served_model_name(args: argparse.Namespace) -> str:
    from syshax.commands.up_stack import SIM_MODEL

    if args.engine != "vllm":
        return SIM_MODEL
    return Path(str(args.model).rstrip("/")).name or "model"


def kill_recorded_engines(state_dir: Path) -> None:
    """Kill engines the process runtime recorded that still run, so nothing is orphaned."""
    if not (state_dir / "engines").is_dir():
        return  # nothing recorded (and the runtime's constructor would create the dirs)
    from agents.runtimes.process import ProcessRuntime

    for engine in ProcessRuntime(state_dir).list({}):
        if engine.status == "running":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(engine.extra["pid"]), signal.SIGKILL)


def run(args: argparse.Namespace) -> int:
    from syshax.commands._django import setup

    if args.engine == "vllm":
        if not args.model:
            print("syshax up: --engine vllm needs --model PATH (a model directory)", flush=True)
            return 2
        local = Path(args.model).expanduser()
        # A local directory (a hub id such as org/name is left to vLLM, as the profile does).
        if local.is_absolute() or local.exists():
            # A local directory: its own limits, checked before anything starts.
            try:
                card = read_model_card(local)
                card.check_max_model_len(args.max_model_len, field="--max-model-len")
                args.context = args.max_model_len or card.max_model_len
            except ModelCardError as exc:
                print(f"syshax up: {exc}", flush=True)
                return 2
        # Two real engines start one after the other, about two minutes each on two cores.
        args.startup_timeout = max(args.startup_timeout, 900.0)
    setup()
    from django.conf import settings
    from django.core.management import call_command

    from syshax.commands.up_stack import (
        ensure_admin,
        ensure_router_api_key,
        ensure_router_benchmark_key,
    )

    var_dir = Path(settings.VAR_DIR)
    call_command("migrate", interactive=False, verbosity=0)
    password = ensure_admin()
    stack = Stack(args, var_dir)
    if not args.no_engines:
        stack.router_api_key, stack.router_api_key_new = ensure_router_api_key(var_dir)
        stack.router_benchmark_key = ensure_router_benchmark_key(var_dir)
    interrupted = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        interrupted = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    status = 0
    try:
        stack.start_control_plane()
        if not args.no_engines:
            stack.start_engines_and_router()
        stack.banner(password)
        if args.benchmark:
            status = stack.benchmark()
        if args.exit:
            if not args.no_engines:
                stack.smoke()
            return status
        stack.say("Ctrl-C stops everything.")
        while True:
            stack.alive()
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0 if interrupted else 130
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"syshax up: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.shutdown()
