"""``syshax profile render``: a profile's engines as the agent would start them, copy-pasteable."""

from __future__ import annotations

import shlex

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from common.containers import container_kwargs
from common.engine_spec import EngineSpec
from controlplane.deployments.render import RenderError, render_profile
from controlplane.deployments.specs import engine_spec
from syshax.cli import main as syshax_main
from testbed.factories import build_deployment

GIB = 1024**3


def lines_of(text: str) -> list[list[str]]:
    """Each rendered shell command as its argv (comments dropped, continuations joined)."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return [shlex.split(cmd) for cmd in body.replace("\\\n", " ").splitlines() if cmd.strip()]


def option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == name]


@pytest.fixture
def vllm_profile(make_profile):
    return make_profile(
        name="ds32b",
        engine="vllm",
        model="/models/DeepSeek-R1-Distill-Qwen-32B",
        cpu_memory_limit_gb=64,
        gpu_env={"HF_TOKEN": "hf_not_for_viewers"},
    )


def test_docker_lines_start_the_gpu_engine_first_and_the_cpu_engine_in_its_ipc_namespace(
    node, vllm_profile
) -> None:
    node.accelerators.update(simulated=False)  # a real card gets a device request
    gpu, cpu = lines_of(render_profile(vllm_profile, node, docker=True).text)
    assert gpu[:2] == cpu[:2] == ["docker", "run"]
    assert option(gpu, "--name") == ["syshax-ds32b-gpu"]
    assert option(gpu, "--ipc") == ["shareable"]
    assert option(gpu, "--shm-size") == [f"{int(vllm_profile.gpu_shm_size_gb)}g"]
    assert option(gpu, "--gpus") == ['"device=GPU-node-a-0"']
    assert option(cpu, "--ipc") == ["container:syshax-ds32b-gpu"]
    assert "--shm-size" not in cpu  # Docker refuses it beside --ipc container:
    assert option(cpu, "--memory") == ["64g"]
    # The cores are the ones a deployment of this profile on this node would get.
    deployment = build_deployment(node, vllm_profile)
    from controlplane.deployments.services import placement_plan

    plan = placement_plan(vllm_profile, node)
    assert option(cpu, "--cpuset-cpus") == [plan["cpuset"]]
    env = dict(e.split("=", 1) for e in option(cpu, "--env"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == plan["custom_cpu_affinity"]
    assert env["PYTHONPATH"] == "/opt/syshax/kvconnector"
    assert any("target=/opt/syshax/kvconnector,readonly" in m for m in option(cpu, "--mount"))
    # Image, then the engine's flags: exactly the agent's, engine names aside.
    spec = EngineSpec.from_dict({**engine_spec(deployment, "cpu"), "name": "syshax-ds32b-cpu"})
    agent_args = list(container_kwargs("x", spec, {}, "cpu", "gpu-id", "/c")["command"])
    image_at = cpu.index(vllm_profile.cpu_image)
    rendered_args = cpu[image_at + 1 :]
    assert len(rendered_args) == len(agent_args)
    differ = [(a, b) for a, b in zip(rendered_args, agent_args, strict=True) if a != b]
    assert all("kv_connector" in a for a, _ in differ)  # only the engine ids in the KV config
    assert "--label" not in gpu + cpu  # a node's agent would adopt labelled containers


def test_process_lines_bind_the_cpu_engine_with_taskset(node, make_profile) -> None:
    profile = make_profile(name="simq")
    gpu, cpu = lines_of(render_profile(profile, node).text)
    assert gpu[gpu.index("syshax") : gpu.index("syshax") + 2] == ["syshax", "sim"]
    assert cpu[cpu.index("taskset") + 1] == "-c"
    assert "--kv-cache-space" in cpu


def test_without_a_node_nothing_is_pinned_and_a_gpu_only_profile_renders_one_line(
    make_profile,
) -> None:
    profile = make_profile(name="solo", enable_cpu_engine=False, gpu_image="img:1")
    rendered = render_profile(profile, None, docker=True)
    (gpu,) = lines_of(rendered.text)
    assert "--cpuset-cpus" not in gpu and "--gpus" not in gpu
    assert "no node" in rendered.text


def test_viewers_see_secret_env_values_hidden(node, vllm_profile) -> None:
    shown = render_profile(vllm_profile, node, docker=True).text
    hidden = render_profile(vllm_profile, node, docker=True, show_secrets=False).text
    assert "HF_TOKEN=hf_not_for_viewers" in shown
    assert "hf_not_for_viewers" not in hidden and "HF_TOKEN=<hidden>" in hidden


@pytest.mark.parametrize(
    ("fields", "docker", "field", "words"),
    [
        ({"engine": "vllm"}, False, "gpu_command", "render with --docker"),
        ({"gpu_image": ""}, True, "gpu_image", "a docker run needs an image"),
        ({"cpu_image": ""}, True, "cpu_image", "a docker run needs an image"),
    ],
)
def test_what_cannot_be_rendered_says_what_to_change(
    node, make_profile, fields, docker, field, words
) -> None:
    profile = make_profile(**fields)
    with pytest.raises(RenderError) as caught:
        render_profile(profile, node, docker=docker)
    assert caught.value.field == field and words in str(caught.value)


def test_cli_render_and_its_errors(node, vllm_profile, make_node, make_profile, capsys) -> None:
    assert syshax_main(["profile", "render", "ds32b", "--docker"]) == 0
    out = capsys.readouterr().out
    assert "--ipc container:syshax-ds32b-gpu" in out and "on node node-a" in out
    assert syshax_main(["profile", "render", "nope"]) == 2
    assert "no profile named 'nope' (profiles: ds32b)" in capsys.readouterr().err
    assert syshax_main(["profile", "render", "ds32b", "--node", "x"]) == 2
    assert "no node named 'x' (nodes: node-a)" in capsys.readouterr().err
    assert syshax_main(["profile", "render", "ds32b"]) == 2
    assert "gpu_command" in capsys.readouterr().err
    make_node("node-b")
    assert syshax_main(["profile", "render", "ds32b", "--docker"]) == 2
    assert "choose one with --node" in capsys.readouterr().err
    tight = make_profile(name="tp4", tensor_parallel_size=4)
    assert syshax_main(["profile", "render", tight.name, "--node", "node-b"]) == 2
    assert "tensor_parallel_size" in capsys.readouterr().err
    assert syshax_main(["profile", "list"]) == 0
    assert "ds32b  vllm" in capsys.readouterr().out


def _login(*perms: str) -> Client:
    user = User.objects.create_user(f"u{len(perms)}", password="x-unused-x")
    user.user_permissions.set(Permission.objects.filter(codename__in=perms))
    client = Client()
    client.force_login(user)
    return client


def test_the_dashboard_profile_page_renders_for_the_chosen_node(node, vllm_profile) -> None:
    viewer = _login()
    page = viewer.get(f"/profiles/{vllm_profile.name}/?node={node.name}")
    assert page.status_code == 200
    html = page.content.decode()
    assert "--ipc container:syshax-ds32b-gpu" in html
    assert "HF_TOKEN=&lt;hidden&gt;" in html and "hf_not_for_viewers" not in html
    assert "gpu_command" in html  # the process render explains why it cannot
    editor = _login("change_deploymentprofile")
    assert "hf_not_for_viewers" in editor.get(f"/profiles/{vllm_profile.name}/").content.decode()
    assert viewer.get("/profiles/nope/").status_code == 404


def test_the_admin_change_page_shows_the_docker_lines(admin_user, vllm_profile) -> None:
    client = Client()
    client.force_login(admin_user)
    html = client.get(f"/admin/deployments/deploymentprofile/{vllm_profile.pk}/change/")
    text = html.content.decode()
    assert "--ipc container:syshax-ds32b-gpu" in text
    assert "HF_TOKEN=&lt;hidden&gt;" in text  # the form's own field shows it to editors
