"""Profiles through Django's test client: the list, a profile's page (every setting, its
command lines, where it fits), the edit form, and the friendly 404/500 pages with DEBUG on."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from controlplane.core.models import AuditEntry
from controlplane.dashboard.profile_forms import SETTINGS, ProfileForm
from controlplane.deployments.models import AcceleratorClaim, DeploymentProfile
from tests.dashboard.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def form_data(profile: DeploymentProfile, **changes: str) -> dict[str, str]:
    """The edit form as a browser posts it: every setting as text, a box only when ticked."""
    form = ProfileForm(instance=profile)
    data: dict[str, str] = {}
    for name in SETTINGS:
        value = form.fields[name].prepare_value(form[name].value())
        if value is True:
            data[name] = "on"
        elif value is not False:
            data[name] = "" if value is None else str(value)
    return {**data, **changes}


@pytest.fixture
def vm_with_its_deployment(make_node, make_profile, make_deployment) -> dict[str, Any]:
    """`syshax up`'s shape: one small node whose cores and card the profile's own running
    deployment holds."""
    node = make_node("vm", sockets=1, numa=1, cores_per_numa=4)
    profile = make_profile(
        name="local-hetero", gpu_env={"HF_TOKEN": "hf_secret_value"}, cpu_extra_args=["--seed", "7"]
    )
    deployment = make_deployment(
        name="local-hetero",
        node=node,
        profile=profile,
        state="running",
        desired_state="running",
        affinity_plan={"cpuset": "0-3", "gpu_cpuset": ""},
    )
    AcceleratorClaim.objects.create(accelerator=node.accelerators.get(), deployment=deployment)
    return {"node": node, "profile": profile, "deployment": deployment}


def test_profiles_are_listed_in_the_navigation(
    viewer_client: Client, vm_with_its_deployment, make_profile
) -> None:
    make_profile(name="gpu-only-tp2", tensor_parallel_size=2, enable_cpu_engine=False)
    response = viewer_client.get(reverse("dashboard:profiles"))
    assert response.status_code == 200
    html = response.content.decode()
    assert f'<a href="{reverse("dashboard:profiles")}" aria-current="page">Profiles</a>' in html
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(
            r'<tr><th scope="row"><a href="/profiles/([^/]+)/">.*?</tr>', html, re.S
        )
    }
    assert set(rows) == {"local-hetero", "gpu-only-tp2"}
    cells = lambda row: re.findall(r"<td>(.*?)</td>", row, re.S)  # noqa: E731
    assert cells(rows["local-hetero"])[1:] == ["simulator", "1", "on", "1"]
    assert cells(rows["gpu-only-tp2"])[1:] == ["simulator", "2", "off", "0"]
    assert "deepseek-r1-distill-qwen-32b" in rows["local-hetero"]
    assert "New profile" not in html  # the viewer may not add one
    # Every page links the list.
    overview = viewer_client.get(reverse("dashboard:overview")).content.decode()
    assert f'href="{reverse("dashboard:profiles")}"' in overview


def test_the_profile_page_shows_every_setting_and_masks_the_env(
    viewer_client: Client, operator_client: Client, vm_with_its_deployment
) -> None:
    profile = vm_with_its_deployment["profile"]
    url = reverse("dashboard:profile", args=[profile.name])
    html = viewer_client.get(url).content.decode()
    for name in SETTINGS:
        assert f'id="setting-{name}"' in html, name
    for group in ("Model", "GPU engine", "CPU engine", "PD handoff and KV", "Environment"):
        assert f">{group}</h3>" in html
    assert escape("HF_TOKEN=<hidden>") in html and "hf_secret_value" not in html
    assert "<code>--seed</code><br><code>7</code>" in html
    assert "Edit the settings" not in html
    html = operator_client.get(url).content.decode()
    assert "HF_TOKEN=hf_secret_value" in html
    assert "Edit the settings" in html


def test_the_profile_page_renders_both_command_lines(
    operator_client: Client, vm_with_its_deployment
) -> None:
    profile = vm_with_its_deployment["profile"]
    html = operator_client.get(reverse("dashboard:profile", args=[profile.name])).content.decode()
    # The node of its deployment is chosen; its own cores are what the engines would get.
    assert '<option value="vm" selected>' in html
    assert 'id="render-docker"' in html and "docker run" in html
    assert 'id="render-process"' in html and "taskset -c" in html


def test_own_deployments_do_not_count_against_the_fit(
    viewer_client: Client, vm_with_its_deployment, make_profile, make_node
) -> None:
    profile = vm_with_its_deployment["profile"]
    make_node("no-cards", accelerators=0)
    html = viewer_client.get(reverse("dashboard:profile", args=[profile.name])).content.decode()
    assert 'role="alert"' not in html  # the normal case: its own deployment runs there
    assert "no free CPU cores" not in html
    vm_row = re.search(r'<tr data-node="vm" data-fits="(\w+)">(.*?)</tr>', html, re.S)
    assert vm_row is not None and vm_row.group(1) == "yes"
    assert "counting what local-hetero of this profile holds as free" in vm_row.group(2)
    bare = re.search(r'<tr data-node="no-cards" data-fits="(\w+)">(.*?)</tr>', html, re.S)
    assert bare is not None and bare.group(1) == "no"
    assert "tensor_parallel_size: is 1 but node &#x27;no-cards&#x27; has 0" in bare.group(2)
    # Another profile on the same node does meet the deployment's cores and card.
    other = make_profile(name="other", gpu_port=7101, cpu_port=7102)
    html = viewer_client.get(reverse("dashboard:profile", args=[other.name])).content.decode()
    vm_row = re.search(r'<tr data-node="vm" data-fits="(\w+)">(.*?)</tr>', html, re.S)
    assert vm_row is not None and vm_row.group(1) == "no"
    assert "free" in vm_row.group(2) and "card" in vm_row.group(2)


def test_every_bad_field_is_shown_at_once_and_nothing_is_saved(
    operator_client: Client, vm_with_its_deployment
) -> None:
    profile = vm_with_its_deployment["profile"]
    before = {f: getattr(profile, f) for f in SETTINGS}
    data = form_data(
        profile,
        tensor_parallel_size="0",  # the field's limit
        max_num_seqs="many",  # not a number
        gpu_memory_utilization="1.5",  # clean()
        cpu_port=str(profile.gpu_port),  # clean()
        gpu_env="HF_TOKEN=x\nno equals sign",  # the form's own conversion
        cpu_affinity_mode="explicit",  # clean(): needs cpu_affinity
        cpu_affinity="",
    )
    response = operator_client.post(reverse("dashboard:profile-edit", args=[profile.name]), data)
    assert response.status_code == 400
    html = response.content.decode()
    expected = {
        "tensor_parallel_size": "Ensure this value is greater than or equal to 1.",
        "max_num_seqs": "A valid integer is required.",
        "gpu_memory_utilization": "must be in (0, 1]; got 1.5",
        "cpu_port": f"must differ from gpu_port ({profile.gpu_port})",
        "gpu_env": "line 2: expected NAME=VALUE, got &#x27;no equals sign&#x27;",
        "cpu_affinity": "is required when cpu_affinity_mode is explicit",
    }
    assert f"{len(expected)} settings to correct" in html
    for field, message in expected.items():
        # In the summary at the top, linked to its field ...
        assert f'<a href="#id_{field}">{field}</a>: {message}</li>' in html, field
        # ... and beside the field itself.
        beside = re.search(
            rf'<div class="field invalid">\s*<label for="id_{field}">.*?</div>', html, re.S
        )
        assert beside is not None and message in beside.group(0), field
    profile.refresh_from_db()
    assert {f: getattr(profile, f) for f in SETTINGS} == before
    assert not AuditEntry.objects.filter(action__startswith="profile.").exists()


def test_saving_writes_the_fields_and_an_audit_row(
    operator_client: Client, operator: User, vm_with_its_deployment
) -> None:
    profile = vm_with_its_deployment["profile"]
    edit = reverse("dashboard:profile-edit", args=[profile.name])
    form = operator_client.get(edit).content.decode()
    # Fields, not JSON boxes: the env is NAME=VALUE lines, the arguments one per line.
    assert re.search(r'<textarea name="gpu_env"[^>]*>\s*HF_TOKEN=hf_secret_value</textarea>', form)
    assert re.search(r'<textarea name="cpu_extra_args"[^>]*>\s*--seed\n7</textarea>', form)
    assert "{" not in re.search(
        r'<textarea name="cpu_env"[^>]*>(.*?)</textarea>', form, re.S
    ).group(1)
    data = form_data(
        profile,
        max_num_seqs="128",
        max_model_len="",  # empty: the model's own
        gpu_extra_args="--enforce-eager\n\n--seed\n3",
        cpu_env="VLLM_LOGGING_LEVEL=DEBUG\nEMPTY=",
    )
    data.pop("enable_cpu_engine")  # unticked: GPU only
    response = operator_client.post(edit, data)
    assert response.status_code == 302, response.content.decode()[:3000]
    assert response["Location"] == reverse("dashboard:profile", args=[profile.name])
    profile.refresh_from_db()
    assert profile.max_num_seqs == 128 and profile.max_model_len is None
    assert profile.gpu_extra_args == ["--enforce-eager", "--seed", "3"]
    assert profile.cpu_env == {"VLLM_LOGGING_LEVEL": "DEBUG", "EMPTY": ""}
    assert profile.enable_cpu_engine is False
    assert profile.gpu_env == {"HF_TOKEN": "hf_secret_value"}  # unchanged
    entry = AuditEntry.objects.get(action="profile.updated")
    assert entry.actor == operator and entry.object_id == str(profile.pk)
    assert entry.detail["fields"] == [
        "cpu_env",
        "enable_cpu_engine",
        "gpu_extra_args",
        "max_model_len",
        "max_num_seqs",
    ]
    page = operator_client.get(response["Location"]).content.decode()
    assert "1 deployment(s) use it: each starts from the new settings on its next deploy" in page


def test_a_new_profile_from_the_form(operator_client: Client, operator: User) -> None:
    new = reverse("dashboard:profile-create")
    form = operator_client.get(new)
    assert form.status_code == 200
    data = form_data(DeploymentProfile(), name="fresh", model="Qwen/Qwen2.5-7B-Instruct")
    response = operator_client.post(new, data)
    assert response.status_code == 302, response.content.decode()[:3000]
    profile = DeploymentProfile.objects.get(name="fresh")
    assert profile.model == "Qwen/Qwen2.5-7B-Instruct" and profile.gpu_port == 7001
    assert AuditEntry.objects.get(action="profile.created").object_id == str(profile.pk)
    # The same name twice is the API's own unique check, beside the field.
    again = operator_client.post(new, data)
    assert again.status_code == 400
    assert "deployment profile with this name already exists." in again.content.decode()


def test_changing_profiles_needs_the_permission(
    viewer_client: Client, vm_with_its_deployment
) -> None:
    profile = vm_with_its_deployment["profile"]
    edit = reverse("dashboard:profile-edit", args=[profile.name])
    new = reverse("dashboard:profile-create")
    for url in (edit, new):
        for response in (viewer_client.get(url), viewer_client.post(url, form_data(profile))):
            assert response.status_code == 403 and b"Not allowed" in response.content
    # Changing is not adding: each form needs its own permission.
    user = User.objects.create_user("editor", password=PASSWORD)
    user.user_permissions.set(Permission.objects.filter(codename="change_deploymentprofile"))
    editor = Client()
    editor.force_login(user)
    assert editor.get(edit).status_code == 200
    assert editor.get(new).status_code == 403
    assert not AuditEntry.objects.filter(action__startswith="profile.").exists()


def test_the_form_and_the_page_cover_every_setting_once() -> None:
    stored = {
        f.name
        for f in DeploymentProfile._meta.concrete_fields
        if f.name not in ("id", "created_at", "updated_at")
    }
    assert sorted(SETTINGS) == sorted(stored)


def test_not_found_is_friendly_with_debug_on_as_syshax_up_runs(
    settings, operator_client: Client
) -> None:
    settings.DEBUG = True  # controlplane.settings.local and `syshax init`'s env file
    for url in ("/nowhere/", "/profiles/nope/", "/profiles/nope/edit/", "/deployments/999999/"):
        response = operator_client.get(url)
        html = response.content.decode()
        assert response.status_code == 404, url
        assert "Page not found" in html and "<nav" in html, url
        assert "URLconf" not in html and "Traceback" not in html and "DEBUG" not in html, url
    api = operator_client.get("/api/v1/nowhere/")
    assert api.status_code == 404 and api["Content-Type"].startswith("application/json")


@pytest.mark.parametrize("debug", [True, False])
def test_a_server_error_shows_no_traceback(
    settings, operator: User, vm_with_its_deployment, monkeypatch, debug: bool
) -> None:
    settings.DEBUG = debug

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret detail of the failure")

    monkeypatch.setattr("controlplane.dashboard.views.profiles.settings_of", broken)
    client = Client(raise_request_exception=False)
    client.force_login(operator)
    profile = vm_with_its_deployment["profile"]
    response = client.get(reverse("dashboard:profile", args=[profile.name]))
    html = response.content.decode()
    assert response.status_code == 500 and "Something went wrong" in html
    assert "Traceback" not in html and "secret detail" not in html
    assert "RuntimeError" not in html and "settings" not in html.lower()
