"""The Kubernetes manifests under deploy/k8s agree with quayutec.config and with the design.

Each overlay is rendered with ``kubectl kustomize``, validated against the Kubernetes
OpenAPI schemas with ``kubernetes-validate --strict``, then read back and checked against
``quayutec.config.SERVICES``: ports, probes, Services, addresses, env wiring, pod security,
and a small NetworkPolicy evaluator that proves only the Gateway is reachable from outside.
"""

from __future__ import annotations

import base64
import importlib.util
import ipaddress
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from quayutec.config import (
    DATA_DIR_ENV,
    DATABASE_URL_ENV,
    ENCRYPTION_KEY_ENV,
    GATEWAY,
    RUNTIME,
    SERVICES,
    WITH_DATABASE,
    ConnectionBudget,
    ServiceSpec,
)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# Kubernetes versions to validate against (schemas shipped by kubernetes-validate).
K8S_VERSIONS = ("1.34.0",)
APP_LABEL = ("app.kubernetes.io/part-of", "quayutec")
NAME_LABEL = "app.kubernetes.io/name"
APP_UID = 10001

# Which service needs which secret, and whom it dials (the services' wiring).
NEEDS_DATABASE = {"gateway", "room", "claims", "migrate"}
# Only Room decrypts provider keys; Runtime gets a run's key from Room and never holds the key of keys.
NEEDS_ENCRYPTION_KEY = {"room"}
# The Gateway seals sign-in providers' client secrets under a key of its own, never the Room's.
GATEWAY_ENCRYPTION_KEY_ENV = "QUAYUTEC_GATEWAY_ENCRYPTION_KEY"
NEEDS_GATEWAY_ENCRYPTION_KEY = {"gateway"}
DIALS = {"gateway": {"room", "runtime"}, "runtime": {"claims", "room"}, "room": set(), "claims": set()}
SPECS = {spec.name: spec for spec in SERVICES}
# (workload, port) pairs that may be reached from outside the app. Nothing else.
EXTERNALLY_REACHABLE = {("gateway", GATEWAY.port), ("console", 8080), ("jaeger", 16686)}
# Secrets the prod overlay expects the operator to create (documented in deploy/k8s/README.md).
Obj = dict[str, Any]  # one parsed Kubernetes object (or part of one)
# Each service's mutual-TLS certificate: ca.crt, tls.crt, tls.key (a cert-manager Certificate's Secret).
MTLS_SECRETS = {name: f"quayutec-mtls-{name}" for name in ("gateway", "room", "claims", "runtime", "console")}
PROD_EXTERNAL_SECRETS = {"quayutec-database", "quayutec-secrets", "quayutec-gateway-tls", *MTLS_SECRETS.values()}


# ---------------------------------------------------------------- rendering


def _kubectl() -> str:
    """kubectl renders the overlays; without it these tests fail (never skip) and say what to install."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not on PATH, so the kustomize overlays cannot be rendered and validated: install kubectl "
            "(for example `apt-get install kubectl` or the release binary) and run the tests again"
        )
    return kubectl


def _validator() -> list[str]:
    """kubernetes-validate (the dev extra) checks the rendered objects; its absence fails the tests."""
    script = Path(sys.executable).with_name("kubernetes-validate")
    if script.exists():
        return [str(script)]
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.fail(
            "kubernetes-validate is not installed in this Python, so the overlays cannot be validated: "
            "install the dev extra (`pip install -e '.[dev]'`, as `make test` does)"
        )
    return [sys.executable, "-m", "kubernetes_validate"]


_RENDERED: dict[str, str] = {}
# The dev overlay needs its mutual-TLS files, made at apply time (scripts/dev_k8s_mtls.py): it is
# rendered from a copy of deploy/k8s where the script wrote them, as a developer's apply would.
_WORK = tempfile.TemporaryDirectory(prefix="qy-k8s-")


def prepared_k8s() -> Path:
    """A copy of deploy/k8s whose dev overlay has the files the script makes (made once)."""
    copy = Path(_WORK.name) / "k8s"
    if not copy.exists():
        shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("mtls"))
        made = subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "dev_k8s_mtls.py"),
                "--pki",
                str(Path(_WORK.name) / "pki"),
                "--out",
                str(copy / "overlays" / "dev" / "mtls"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert made.returncode == 0, f"scripts/dev_k8s_mtls.py failed:\n{made.stderr}"
    return copy


def render(overlay: str) -> str:
    if overlay not in _RENDERED:
        kubectl = _kubectl()
        root = prepared_k8s() if overlay == "dev" else K8S
        result = subprocess.run(
            [kubectl, "kustomize", str(root / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"kubectl kustomize {overlay} failed:\n{result.stderr}"
        _RENDERED[overlay] = result.stdout
    return _RENDERED[overlay]


class Rendered:
    def __init__(self, text: str) -> None:
        self.docs = [d for d in yaml.safe_load_all(text) if d]

    def of(self, kind: str) -> list[Obj]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj:
        found = [d for d in self.of(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
        return found[0]

    def find(self, kind: str, name: str) -> Obj | None:
        found = [d for d in self.of(kind) if d["metadata"]["name"] == name]
        return found[0] if found else None

    def workloads(self) -> list[Obj]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]

    def pod_spec(self, workload: Obj) -> Obj:
        spec: Obj = workload["spec"]["template"]["spec"]
        return spec

    def pod_labels(self, workload: Obj) -> Obj:
        labels: Obj = workload["spec"]["template"]["metadata"].get("labels", {})
        return labels

    def configmap(self, name: str) -> Obj:
        data: Obj = self.get("ConfigMap", name).get("data", {})
        return data

    def secret_names(self) -> set[str]:
        return {d["metadata"]["name"] for d in self.of("Secret")}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def rendered(overlay: str) -> Rendered:
    return Rendered(render(overlay))


def app_container(r: Rendered, name: str) -> Obj:
    deploy = r.get("Deployment", name)
    containers = [c for c in r.pod_spec(deploy)["containers"] if c["name"] == name]
    assert len(containers) == 1, f"Deployment {name} has no container named {name}"
    container: Obj = containers[0]
    return container


def effective_env(r: Rendered, container: Obj) -> dict[str, Any]:
    """Env as the container sees it: envFrom ConfigMaps first, then env (which wins).

    Literal values stay strings; valueFrom entries become the dict that describes them.
    """
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            data = r.configmap(source["configMapRef"]["name"])
            prefix = source.get("prefix", "")
            env.update({prefix + k: v for k, v in data.items()})
        elif "secretRef" in source:
            secret = r.find("Secret", source["secretRef"]["name"])
            for key in (secret or {}).get("data", {}):
                env[source.get("prefix", "") + key] = {"secretRef": source["secretRef"]["name"]}
    for item in container.get("env", []):
        env[item["name"]] = item["value"] if "value" in item else item.get("valueFrom", {})
    return env


# ---------------------------------------------------------------- (a) schema validation


def test_overlays_present() -> None:
    assert {"dev", "prod"} <= set(OVERLAYS), f"overlays found: {OVERLAYS}"


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_overlay_validates_strict(overlay: str, k8s_version: str, tmp_path: Path) -> None:
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(render(overlay))
    result = subprocess.run(
        [*_validator(), "--strict", "-k", k8s_version, "--quiet", str(manifest)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"kubernetes-validate --strict -k {k8s_version} failed for {overlay}:\n{result.stdout}\n{result.stderr}"
    )


def test_validator_rejects_a_bad_manifest(tmp_path: Path) -> None:
    """Guard against a validator that passes everything (wrong flags, no schemas)."""
    _kubectl()
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  bogus: 1\n")
    result = subprocess.run(
        [*_validator(), "--strict", "-k", K8S_VERSIONS[0], "--quiet", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0


# ---------------------------------------------------------------- (b) agreement with config


def _probe_port(probe: Obj, container: Obj) -> int:
    handler = probe.get("grpc") or probe.get("tcpSocket")
    assert handler is not None, f"probe is neither grpc nor tcpSocket: {probe}"
    port = handler["port"]
    if isinstance(port, str):
        named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        port = named[port]
    return int(port)


@pytest.mark.parametrize("spec", SERVICES, ids=lambda s: s.name)
def test_deployment_ports_and_probes(rendered: Rendered, spec: ServiceSpec) -> None:
    container = app_container(rendered, spec.name)
    assert container["command"] == ["python", "-m", f"services.{spec.name}"]
    grpc_ports = [p for p in container["ports"] if p.get("name") == "grpc"]
    assert len(grpc_ports) == 1 and grpc_ports[0]["containerPort"] == spec.port
    env = effective_env(rendered, container)
    tls = bool(env.get(f"{spec.prefix}TLS_CERT"))
    # The internal services admit only mutual TLS on their port; the kubelet probes their
    # plaintext health-only port.
    probed = spec.port if spec.public else int(env[spec.health_listen_env].rpartition(":")[2])
    if not spec.public:
        assert probed != spec.port and probed in {p["containerPort"] for p in container["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        assert probe, f"{spec.name}: no {kind}"
        assert _probe_port(probe, container) == probed, f"{spec.name} {kind} port"
        if tls:
            # The kubelet's gRPC probe speaks plaintext only; TLS pods get TCP probes.
            assert spec is GATEWAY and "tcpSocket" in probe, f"{spec.name} {kind} with TLS"
        else:
            assert "grpc" in probe, f"{spec.name} {kind} must be a native gRPC probe"
            assert probe["grpc"].get("service", "") in ("", spec.grpc_service)
    if not tls:
        assert container["readinessProbe"]["grpc"].get("service") == spec.grpc_service


@pytest.mark.parametrize("spec", SERVICES, ids=lambda s: s.name)
def test_service_targets_grpc_port(rendered: Rendered, spec: ServiceSpec) -> None:
    deploy = rendered.get("Deployment", spec.name)
    service = rendered.get("Service", spec.name)
    ports = [p for p in service["spec"]["ports"] if p.get("name") == "grpc"]
    assert len(ports) == 1
    port = ports[0]
    assert port["port"] == spec.port
    assert port.get("appProtocol") == "grpc"
    assert port.get("targetPort") in ("grpc", spec.port)
    selector = service["spec"]["selector"]
    labels = rendered.pod_labels(deploy)
    assert selector.items() <= labels.items(), f"Service {spec.name} does not select its pods"
    for other in rendered.workloads():
        if other is not deploy:
            assert not selector.items() <= rendered.pod_labels(other).items(), (
                f"Service {spec.name} also selects {other['kind']}/{other['metadata']['name']}"
            )


def test_configmap_addresses(rendered: Rendered) -> None:
    data = rendered.configmap("quayutec-config")
    services = {s["metadata"]["name"]: s for s in rendered.of("Service")}
    for spec in SERVICES:
        if spec.addr_env not in data:
            continue
        host, _, port = data[spec.addr_env].rpartition(":")
        assert int(port) == spec.port, f"{spec.addr_env}={data[spec.addr_env]}"
        assert host.split(".")[0] == spec.name and host.split(".")[0] in services, (
            f"{spec.addr_env} host {host!r} is not the {spec.name} Service"
        )
    for name, needed in DIALS.items():
        env = effective_env(rendered, app_container(rendered, name))
        for target in needed:
            assert SPECS[target].addr_env in env, f"{name} lacks {SPECS[target].addr_env}"
    assert int(data.get(f"{RUNTIME.prefix}MAX_RUNS", "32")) >= 1


@pytest.mark.parametrize("spec", SERVICES, ids=lambda s: s.name)
def test_listen_and_otel_env(rendered: Rendered, spec: ServiceSpec) -> None:
    env = effective_env(rendered, app_container(rendered, spec.name))
    if spec.listen_env in env:
        assert env[spec.listen_env].rpartition(":")[2] == str(spec.port)
    for name in env:
        if name.endswith("_LISTEN") and name.startswith("QUAYUTEC_"):
            own = (spec.listen_env, spec.health_listen_env, f"{spec.prefix}CONSOLE_LISTEN")
            assert name in own, f"{spec.name} sets another service's {name}"
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert endpoint, f"{spec.name}: OTEL_EXPORTER_OTLP_ENDPOINT unset"
    parsed = urlsplit(endpoint)
    assert parsed.hostname == "jaeger" and parsed.port == 4317
    jaeger = rendered.get("Service", "jaeger")
    assert 4317 in {p["port"] for p in jaeger["spec"]["ports"]}
    assert env.get("OTEL_SERVICE_NAME") == f"quayutec-{spec.name}"
    assert env.get("OTEL_TRACES_EXPORTER") == "otlp"


def test_secret_wiring(rendered: Rendered, overlay: str) -> None:
    workloads = {name: app_container(rendered, name) for name in SPECS}
    job = rendered.get("Job", "quayutec-migrate")
    (migrate,) = rendered.pod_spec(job)["containers"]
    assert migrate["command"] == ["python", "-m", "quayutec.migrate"]
    workloads["migrate"] = migrate
    present = rendered.secret_names()
    for name, container in workloads.items():
        env = effective_env(rendered, container)
        for var, needers in (
            (DATABASE_URL_ENV, NEEDS_DATABASE),
            (ENCRYPTION_KEY_ENV, NEEDS_ENCRYPTION_KEY),
            (GATEWAY_ENCRYPTION_KEY_ENV, NEEDS_GATEWAY_ENCRYPTION_KEY),
        ):
            if name not in needers:
                assert var not in env, f"{name} must not receive {var}"
                continue
            ref = env.get(var)
            assert isinstance(ref, dict) and "secretKeyRef" in ref, f"{name}: {var} must come from a Secret"
            secret = ref["secretKeyRef"]["name"]
            if secret in present:
                data = rendered.get("Secret", secret).get("data", {})
                assert ref["secretKeyRef"]["key"] in data, f"{name}: {secret} lacks {ref['secretKeyRef']['key']}"
            else:
                assert overlay == "prod" and secret in PROD_EXTERNAL_SECRETS, (
                    f"{name}: Secret {secret} is neither rendered nor a documented prod Secret"
                )
        data_dir = env.get(DATA_DIR_ENV)
        assert data_dir, f"{name}: {DATA_DIR_ENV} unset"
        pod = rendered.pod_spec(job if name == "migrate" else rendered.get("Deployment", name))
        empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        mounts = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in empty_dirs]
        assert any(data_dir == m or data_dir.startswith(m.rstrip("/") + "/") for m in mounts), (
            f"{name}: {DATA_DIR_ENV}={data_dir} is not on a writable emptyDir"
        )


def test_dev_secrets_point_at_dev_postgres() -> None:
    r = Rendered(render("dev"))
    (secret,) = [s for s in r.of("Secret") if s["metadata"]["name"].startswith("quayutec-secrets")]
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    url = urlsplit(data[DATABASE_URL_ENV])
    assert url.scheme.startswith("postgres") and url.hostname == "postgres" and url.port == 5432
    assert 5432 in {p["port"] for p in r.get("Service", "postgres")["spec"]["ports"]}
    (pg,) = r.pod_spec(r.get("StatefulSet", "postgres"))["containers"]
    assert pg["image"].startswith("postgres:16.")
    assert len(base64.urlsafe_b64decode(data[ENCRYPTION_KEY_ENV])) == 32, "not a Fernet key"
    assert len(base64.urlsafe_b64decode(data[GATEWAY_ENCRYPTION_KEY_ENV])) == 32, "not a Fernet key"


# ---------------------------------------------------------------- pod security


def test_every_container_is_non_root_read_only(rendered: Rendered) -> None:
    for workload in rendered.workloads():
        pod = rendered.pod_spec(workload)
        pod_sc = pod.get("securityContext", {})
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        assert pod.get("hostNetwork") is not True and pod.get("hostPID") is not True, where
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c.get("securityContext", {})
            eff = {**pod_sc, **sc}
            label = f"{where} container {c['name']}"
            assert eff.get("runAsNonRoot") is True, f"{label}: runAsNonRoot"
            assert eff.get("runAsUser", 0) != 0, f"{label}: runAsUser must be set and non-zero"
            assert sc.get("readOnlyRootFilesystem") is True, f"{label}: readOnlyRootFilesystem"
            assert sc.get("allowPrivilegeEscalation") is False, f"{label}: allowPrivilegeEscalation"
            assert sc.get("privileged") is not True, label
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{label}: drop ALL"
            assert not sc.get("capabilities", {}).get("add"), f"{label}: adds capabilities"
            assert eff.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{label}: seccomp"
            assert c.get("resources", {}).get("requests") and c["resources"].get("limits"), f"{label}: resources"
            assert "/tmp" in {m["mountPath"] for m in c.get("volumeMounts", [])}, f"{label}: no /tmp mount"
    for spec in SERVICES:
        deploy = rendered.get("Deployment", spec.name)
        pod = rendered.pod_spec(deploy)
        assert pod.get("terminationGracePeriodSeconds") == 30
        assert pod["securityContext"]["runAsUser"] == APP_UID
        assert app_container(rendered, spec.name)["securityContext"]["runAsUser"] == APP_UID
        assert deploy["spec"]["replicas"] >= 2
        assert rendered.pod_labels(deploy).get(APP_LABEL[0]) == APP_LABEL[1]


def test_pdbs_and_hpas(rendered: Rendered) -> None:
    for spec in SERVICES:
        pdb = rendered.get("PodDisruptionBudget", spec.name)
        assert pdb["spec"]["minAvailable"] == 1
        labels = rendered.pod_labels(rendered.get("Deployment", spec.name))
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for name in ("gateway", "runtime"):
        hpa = rendered.get("HorizontalPodAutoscaler", name)
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name)
        assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
        assert hpa["spec"]["minReplicas"] >= 2
        assert "cpu" in app_container(rendered, name)["resources"]["requests"], "HPA on CPU needs a CPU request"


# Jaeger v2: the release the image runs, and its Go module's tag, which tools/jaeger pins for the tests'
# Jaeger and `make jaeger` (Jaeger 2.x releases are tagged v1.(x+63) in the Go module).
JAEGER_RELEASE = "2.12.0"
JAEGER_MODULE = "v1.75.0"
JAEGER_CONFIG = K8S / "base" / "jaeger-config.yaml"
JAEGER_CONFIG_PATH = "/etc/jaeger/config.yaml"
# ${env:NAME} or ${env:NAME:-default}, as the OpenTelemetry Collector's config resolver reads them.
_ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def resolve_env_refs(text: str, env: dict[str, Any]) -> str:
    """The config as the collector would read it with ``env``: each reference replaced by its value,
    else by its default; a reference with neither fails (the collector would read an empty string)."""

    def value(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            assert isinstance(env[name], str), f"{name} must be a literal value, got {env[name]}"
            return str(env[name])
        assert default is not None, f"the Jaeger config reads {name}, which has no default and is not set"
        return default

    return _ENV_REF.sub(value, text)


def jaeger_container(r: Rendered) -> Obj:
    containers: list[Obj] = r.pod_spec(r.get("Deployment", "jaeger"))["containers"]
    assert len(containers) == 1, f"the Jaeger pod runs {len(containers)} containers"
    return containers[0]


def jaeger_config(r: Rendered) -> tuple[Obj, str]:
    """The config the Jaeger container reads (the ConfigMap mounted at --config's path) and its raw text."""
    container = jaeger_container(r)
    pod = r.pod_spec(r.get("Deployment", "jaeger"))
    args = container.get("args", [])
    assert args == ["--config", JAEGER_CONFIG_PATH], f"Jaeger must start with our config: args {args}"
    directory, _, filename = JAEGER_CONFIG_PATH.rpartition("/")
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == directory]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "configMap" in volume, f"{directory} is not a ConfigMap volume: {volume}"
    items = {i["path"]: i["key"] for i in volume["configMap"].get("items", [])}
    key = items.get(filename, filename)
    data = r.configmap(volume["configMap"]["name"])
    assert key in data, f"ConfigMap {volume['configMap']['name']} has no {key}"
    text: str = data[key]
    config: Obj = yaml.safe_load(resolve_env_refs(text, effective_env(r, container)))
    return config, text


def test_jaeger_is_v2_at_the_pinned_release(rendered: Rendered) -> None:
    """The image is Jaeger v2 at the release whose Go module tools/jaeger pins: the cluster runs the
    Jaeger the tests run."""
    container = jaeger_container(rendered)
    assert container["image"] == f"jaegertracing/jaeger:{JAEGER_RELEASE}", container["image"]
    pinned = re.search(r"^\s*github\.com/jaegertracing/jaeger (v\S+)", (ROOT / "tools/jaeger/go.mod").read_text(), re.M)
    assert pinned is not None and pinned.group(1) == JAEGER_MODULE, (
        f"tools/jaeger pins {pinned and pinned.group(1)}, the image runs Jaeger {JAEGER_RELEASE} ({JAEGER_MODULE}): "
        "move both together"
    )
    # Nothing of Jaeger v1 (all-in-one, its admin and collector ports, its env) is left in the manifests
    # or their README.
    rendered_overlays = "\n".join(render(name) for name in OVERLAYS)
    assert "jaegertracing/jaeger:" in rendered_overlays
    readme = (K8S / "README.md").read_text()
    for where, text in (("the rendered overlays", rendered_overlays), ("deploy/k8s/README.md", readme)):
        for v1 in ("all-in-one", "14269", "14250", "COLLECTOR_OTLP_ENABLED", "MEMORY_MAX_TRACES", "SPAN_STORAGE_TYPE"):
            assert v1 not in text, f"{where} still names Jaeger v1's {v1}"


def test_jaeger_runs_our_config_from_its_configmap(rendered: Rendered) -> None:
    """--config names the mounted ConfigMap, generated from deploy/k8s/base/jaeger-config.yaml as it is:
    the OTLP receiver, the jaeger_storage and jaeger_query extensions, the jaeger_storage_exporter."""
    config, text = jaeger_config(rendered)
    assert text == JAEGER_CONFIG.read_text(), "the mounted config is not deploy/k8s/base/jaeger-config.yaml"
    service = config["service"]
    assert {"jaeger_storage", "jaeger_query", "healthcheckv2"} <= set(service["extensions"])
    traces = service["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"] and traces["exporters"] == ["jaeger_storage_exporter"]
    backend = config["exporters"]["jaeger_storage_exporter"]["trace_storage"]
    assert config["extensions"]["jaeger_query"]["storage"]["traces"] == backend
    # In-memory storage, bounded by JAEGER_MAX_TRACES as the Deployment sets it.
    memory = config["extensions"]["jaeger_storage"]["backends"][backend]["memory"]
    env = effective_env(rendered, jaeger_container(rendered))
    assert "JAEGER_MAX_TRACES" in env, "the Deployment must bound the traces Jaeger keeps in memory"
    assert int(memory["max_traces"]) == int(env["JAEGER_MAX_TRACES"])
    assert 0 < int(memory["max_traces"]) <= 10_000, f"max_traces {memory['max_traces']}: too many for the 1Gi limit"
    assert jaeger_container(rendered)["resources"]["limits"]["memory"] == "1Gi"


def test_jaeger_listens_on_all_addresses_in_its_pod(rendered: Rendered) -> None:
    """Every listener of the config (loopback unless told otherwise) is bound to all addresses by the
    Deployment's env, on a port the container declares: the Service and the probes reach each one."""
    container = jaeger_container(rendered)
    config, text = jaeger_config(rendered)
    declared = {p["containerPort"] for p in container["ports"]}
    env = effective_env(rendered, container)
    # Each address the config reads from the environment, with its loopback default, is overridden.
    loopback = {m.group(1) for m in _ENV_REF.finditer(text) if (m.group(2) or "").startswith("127.0.0.1")}
    assert loopback, "the Jaeger config reads no address from the environment"
    for name in sorted(loopback):
        assert name in env, f"the Deployment leaves {name} on loopback: nothing outside the pod would reach it"
        assert str(env[name]).startswith("0.0.0.0"), f"{name}={env[name]} does not bind all addresses"
    extensions = config["extensions"]
    receivers = config["receivers"]["otlp"]["protocols"]
    prometheus = config["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"]
    endpoints = {
        "otlp grpc": receivers["grpc"]["endpoint"],
        "otlp http": receivers["http"]["endpoint"],
        "query http": extensions["jaeger_query"]["http"]["endpoint"],
        "query grpc": extensions["jaeger_query"]["grpc"]["endpoint"],
        "health": extensions["healthcheckv2"]["http"]["endpoint"],
        "metrics": f"{prometheus['host']}:{prometheus['port']}",
    }
    for what, endpoint in endpoints.items():
        host, _, port = str(endpoint).rpartition(":")
        assert host == "0.0.0.0", f"Jaeger's {what} listens on {endpoint}, not on all addresses"
        assert int(port) in declared, f"Jaeger's {what} port {port} is not a containerPort ({sorted(declared)})"
    assert int(endpoints["otlp grpc"].rpartition(":")[2]) == 4317
    assert int(endpoints["otlp http"].rpartition(":")[2]) == 4318
    assert int(endpoints["query http"].rpartition(":")[2]) == 16686
    # The Service: OTLP gRPC and HTTP, the query API and UI, each to the container's port.
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    ports = rendered.get("Service", "jaeger")["spec"]["ports"]
    service = {p["port"]: named.get(p["targetPort"], p["targetPort"]) for p in ports}
    assert service == {4317: 4317, 4318: 4318, 16686: 16686}, service


def test_jaeger_probes_ask_its_health_endpoint(rendered: Rendered) -> None:
    """Readiness and liveness ask the healthcheckv2 extension's GET /status, on the port its config binds."""
    container = jaeger_container(rendered)
    config, _ = jaeger_config(rendered)
    health = config["extensions"]["healthcheckv2"]
    assert health.get("use_v2") is True, "healthcheckv2 answers /status only with use_v2"
    port = int(health["http"]["endpoint"].rpartition(":")[2])
    # The extension's default status path (opentelemetry-collector-contrib internal/healthcheck).
    path = health["http"].get("status", {}).get("path", "/status")
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe].get("httpGet")
        assert get is not None, f"Jaeger's {probe} is not an HTTP GET: {container[probe]}"
        assert get["path"] == path == "/status", f"{probe} asks {get['path']}"
        assert named.get(get["port"], get["port"]) == port, f"{probe} asks port {get['port']}, health is on {port}"


def test_gateway_tls_paths_are_mounted(rendered: Rendered, overlay: str) -> None:
    """prod serves TLS on the Gateway (the gateway-tls component), dev plaintext."""
    container = app_container(rendered, "gateway")
    env = effective_env(rendered, container)
    paths = [env[v] for v in (f"{GATEWAY.prefix}TLS_CERT", f"{GATEWAY.prefix}TLS_KEY") if v in env]
    if overlay == "dev":
        assert paths == [], "the dev overlay's Gateway serves plaintext"
        return
    assert len(paths) == 2, "set both QUAYUTEC_GATEWAY_TLS_CERT and QUAYUTEC_GATEWAY_TLS_KEY"
    pod = rendered.pod_spec(rendered.get("Deployment", "gateway"))
    secret_vols = {v["name"] for v in pod["volumes"] if "secret" in v}
    mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in secret_vols]
    for path in paths:
        assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), f"{path} is not on a Secret volume"


@pytest.mark.parametrize("name", [*(s.name for s in SERVICES), "console"])
def test_each_service_presents_its_own_mtls_certificate(rendered: Rendered, overlay: str, name: str) -> None:
    """Each service, and the console (it calls the Gateway's console port), mounts its own certificate."""
    container = app_container(rendered, name)
    env = effective_env(rendered, container)
    pod = rendered.pod_spec(rendered.get("Deployment", name))
    secret_of = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"] if m["name"] in secret_of}
    for var, key in (
        ("QUAYUTEC_MTLS_CA", "ca.crt"),
        ("QUAYUTEC_MTLS_CERT", "tls.crt"),
        ("QUAYUTEC_MTLS_KEY", "tls.key"),
    ):
        path = env.get(var)
        assert isinstance(path, str) and path.endswith("/" + key), f"{name}: {var}={path!r}"
        folder = path.rpartition("/")[0]
        assert folder in mounts, f"{name}: {path} is not on a Secret volume"
        secret = secret_of[mounts[folder]]
        assert secret.startswith(MTLS_SECRETS[name]), f"{name} mounts {secret}, not its own certificate"
        if overlay == "dev":
            data = rendered.get("Secret", secret)["data"]
            assert key in data, f"{secret} lacks {key}"
            if key == "tls.crt":
                from cryptography import x509

                from quayutec.tls import certificate_identity

                cert = x509.load_pem_x509_certificate(base64.b64decode(data[key]))
                assert certificate_identity(cert) == name, f"{secret} does not name {name}"


def test_the_dev_overlay_commits_no_private_key_and_carries_no_ca_key() -> None:
    """Its mutual-TLS files are made at apply time (ignored by git); the Secrets they become hold
    each identity's own key, matching its certificate, and never the CA's key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from quayutec.tls import IDENTITIES, certificate_identity

    tracked = subprocess.run(
        ["git", "ls-files", str(K8S)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert not [f for f in tracked if f.endswith(".key") or "/mtls/" in f], "a key or certificate is committed"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(K8S / "overlays" / "dev" / "mtls" / "room" / "tls.key")], cwd=ROOT
    )
    assert ignored.returncode == 0, "the dev overlay's generated mtls/ files are not ignored by git"
    r = Rendered(render("dev"))
    ca_key = (Path(_WORK.name) / "pki" / "ca" / "ca.key").read_bytes()
    for name in IDENTITIES:
        (secret,) = [s for s in r.of("Secret") if s["metadata"]["name"].startswith(f"quayutec-mtls-{name}-")]
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        assert sorted(data) == ["ca.crt", "tls.crt", "tls.key"]
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        key = serialization.load_pem_private_key(data["tls.key"], password=None)
        assert certificate_identity(cert) == name
        assert cert.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ) == key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(data["ca.crt"]))
    for secret in r.of("Secret"):
        assert all(base64.b64decode(v) != ca_key for v in secret.get("data", {}).values())


# ---------------------------------------------------------------- network exposure


def _matches(selector: Obj | None, labels: Obj | None) -> bool:
    if selector is None or labels is None:
        return False
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    assert not unknown, f"unsupported selector fields {unknown}"
    if not all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


class Peer:
    """A source of traffic: a pod in this namespace (labels), or anything outside it."""

    def __init__(self, labels: Obj | None = None, same_namespace: bool = True) -> None:
        self.labels = labels
        self.same_namespace = same_namespace and labels is not None


OUTSIDE = Peer(None, same_namespace=False)  # the internet, another cluster, a node IP
OTHER_NAMESPACE_POD = Peer({"app": "intruder"}, same_namespace=False)
UNLABELED_POD = Peer({}, same_namespace=True)


def _peer_allowed(entry: Obj, peer: Peer) -> bool:
    if "ipBlock" in entry:
        # Conservative: any ipBlock may admit outside traffic (or pod IPs).
        net = ipaddress.ip_network(entry["ipBlock"]["cidr"], strict=False)
        return not peer.same_namespace or net.prefixlen == 0
    if "namespaceSelector" in entry:
        # Conservative: a namespace selector may select other namespaces and this one.
        if peer.labels is None:
            return False
        return "podSelector" not in entry or _matches(entry["podSelector"], peer.labels)
    if "podSelector" in entry:
        return peer.same_namespace and _matches(entry["podSelector"], peer.labels)
    return False


def _port_allowed(rule: Obj, port: int, named: dict[str, int]) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    for p in ports:
        if "port" not in p:
            return True
        value = named.get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if value is not None and value <= port <= p.get("endPort", value):
            return True
    return False


def ingress_allowed(r: Rendered, target_labels: Obj, port: int, named: dict[str, int], peer: Peer) -> bool:
    policies = [
        np
        for np in r.of("NetworkPolicy")
        if "Ingress" in np["spec"].get("policyTypes", ["Ingress"])
        and (np["spec"].get("podSelector") in ({}, None) or _matches(np["spec"]["podSelector"], target_labels))
    ]
    if not policies:
        return True  # not isolated
    for np in policies:
        for rule in np["spec"].get("ingress") or []:
            sources = rule.get("from")
            if (not sources or any(_peer_allowed(e, peer) for e in sources)) and _port_allowed(rule, port, named):
                return True
    return False


def _ports(r: Rendered, workload: Obj) -> dict[str, int]:
    named = {}
    for c in r.pod_spec(workload)["containers"]:
        for p in c.get("ports", []):
            named[p.get("name", str(p["containerPort"]))] = p["containerPort"]
    return named


def test_default_deny_ingress(rendered: Rendered) -> None:
    deny = [
        np
        for np in rendered.of("NetworkPolicy")
        if np["spec"].get("podSelector") in ({}, None)
        and "Ingress" in np["spec"].get("policyTypes", [])
        and not np["spec"].get("ingress")
    ]
    assert deny, "no default-deny ingress NetworkPolicy"


def test_only_gateway_is_reachable_from_outside(rendered: Rendered) -> None:
    reachable = set()
    for workload in rendered.workloads():
        name = workload["metadata"]["name"]
        labels = rendered.pod_labels(workload)
        named = _ports(rendered, workload)
        for port in set(named.values()) | {12345}:
            for peer in (OUTSIDE, OTHER_NAMESPACE_POD, UNLABELED_POD):
                if ingress_allowed(rendered, labels, port, named, peer):
                    reachable.add((name, port))
    assert reachable == EXTERNALLY_REACHABLE, f"reachable from outside the app: {sorted(reachable)}"
    for svc in rendered.of("Service"):
        if svc["spec"].get("type", "ClusterIP") in ("LoadBalancer", "NodePort"):
            assert svc["metadata"]["name"] == "gateway", f"Service {svc['metadata']['name']} is exposed"
    assert not rendered.of("Ingress"), "no Ingress objects besides what the README documents"


def test_internal_services_admit_only_their_callers(rendered: Rendered) -> None:
    pods = {w["metadata"]["name"]: w for w in rendered.workloads()}

    def allowed(target: str, source: str) -> bool:
        w = pods[target]
        return ingress_allowed(
            rendered,
            rendered.pod_labels(w),
            SPECS[target].port,
            _ports(rendered, w),
            Peer(rendered.pod_labels(pods[source])),
        )

    # Only the callers of quayutec/authz.py's table reach each service.
    for source in ("gateway", "runtime"):
        assert allowed("room", source), f"{source} cannot reach room"
    for source in ("claims", "jaeger"):
        assert not allowed("room", source), f"{source} may reach room"
    assert allowed("claims", "runtime")
    for source in ("gateway", "room", "jaeger"):
        assert not allowed("claims", source), f"{source} may reach claims; only the runtime may"
    assert allowed("runtime", "gateway")
    for source in ("room", "claims", "runtime", "jaeger"):
        assert not allowed("runtime", source), f"{source} may reach runtime; only the gateway may"
    # The app's pods can export traces.
    jaeger = pods["jaeger"]
    for source in SPECS:
        assert ingress_allowed(
            rendered,
            rendered.pod_labels(jaeger),
            4317,
            _ports(rendered, jaeger),
            Peer(rendered.pod_labels(pods[source])),
        )
    if "postgres" in pods:
        pg = pods["postgres"]
        for source in ("gateway", "room", "claims", "quayutec-migrate"):
            assert ingress_allowed(
                rendered, rendered.pod_labels(pg), 5432, _ports(rendered, pg), Peer(rendered.pod_labels(pods[source]))
            ), f"{source} cannot reach postgres"


def test_jaeger_admits_the_services_otlp_and_nothing_needless(rendered: Rendered) -> None:
    """Jaeger's OTLP/gRPC port admits the four services that export traces, and no other pod; no pod
    reaches its OTLP/HTTP, query gRPC, health or metrics ports; its UI (16686) stays reachable."""
    pods = {w["metadata"]["name"]: w for w in rendered.workloads()}
    jaeger = pods["jaeger"]
    labels, named = rendered.pod_labels(jaeger), _ports(rendered, jaeger)

    def admitted(port: int, peer: Peer) -> bool:
        return ingress_allowed(rendered, labels, port, named, peer)

    exporters = set(SPECS)
    others = {name for name in pods if name not in exporters}
    assert {"console", "quayutec-migrate", "jaeger"} <= others
    for name in sorted(exporters):
        assert admitted(4317, Peer(rendered.pod_labels(pods[name]))), f"{name} cannot export to Jaeger"
    for name in sorted(others):
        assert not admitted(4317, Peer(rendered.pod_labels(pods[name]))), f"{name} may send OTLP to Jaeger"
    for peer in (OUTSIDE, OTHER_NAMESPACE_POD, UNLABELED_POD):
        assert not admitted(4317, peer)
    assert set(named.values()) == {4317, 4318, 16685, 16686, 13133, 8888}, named
    for port in (4318, 16685, 13133, 8888):
        for name in sorted(pods):
            assert not admitted(port, Peer(rendered.pod_labels(pods[name]))), f"{name} reaches Jaeger's {port}"
    assert admitted(16686, OUTSIDE) and admitted(16686, Peer(rendered.pod_labels(pods["console"])))


def test_console(rendered: Rendered, overlay: str) -> None:
    """The console: its own Deployment on 8080 behind the policies, its session secret from a Secret,
    probes on /healthz, a Secure cookie except in dev (plain http through a port-forward)."""
    container = app_container(rendered, "console")
    assert container["command"] == ["python", "-m", "services.console"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8080}
    env = effective_env(rendered, container)
    assert env["QUAYUTEC_CONSOLE_LISTEN"] == "0.0.0.0:8080"
    assert env["QUAYUTEC_GATEWAY_ADDR"] == f"gateway:{GATEWAY.port}"
    ref = env["QUAYUTEC_CONSOLE_SESSION_SECRET"]
    assert isinstance(ref, dict) and ref["secretKeyRef"]["name"].startswith("quayutec-secrets")
    if ref["secretKeyRef"]["name"] in rendered.secret_names():
        data = rendered.get("Secret", ref["secretKeyRef"]["name"]).get("data", {})
        assert len(base64.b64decode(data["QUAYUTEC_CONSOLE_SESSION_SECRET"])) >= 32
    assert env.get("QUAYUTEC_CONSOLE_SECURE_COOKIE", "true") == ("false" if overlay == "dev" else "true")
    assert env.get("QUAYUTEC_CONSOLE_GATEWAY_TLS", "false") == ("true" if overlay == "prod" else "false")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    for name in ("QUAYUTEC_DATABASE_URL", DATABASE_URL_ENV, ENCRYPTION_KEY_ENV):
        assert name not in env, f"the console must not receive {name}"
    # It calls the Gateway's console port (mutual TLS), which only the console's pods may reach.
    gateway = app_container(rendered, "gateway")
    listen = effective_env(rendered, gateway)["QUAYUTEC_GATEWAY_CONSOLE_LISTEN"]
    port = int(listen.rpartition(":")[2])
    assert port in {p["containerPort"] for p in gateway["ports"]}
    assert env["QUAYUTEC_CONSOLE_GATEWAY_CONSOLE_ADDR"] == f"gateway:{port}"
    assert port in {p["port"] for p in rendered.get("Service", "gateway")["spec"]["ports"]}
    pods = {w["metadata"]["name"]: w for w in rendered.workloads()}
    target = pods["gateway"]
    for source, admitted in (("console", True), ("runtime", False), ("jaeger", False)):
        peer = Peer(rendered.pod_labels(pods[source]))
        assert ingress_allowed(rendered, rendered.pod_labels(target), port, _ports(rendered, target), peer) is admitted
    for peer in (OUTSIDE, OTHER_NAMESPACE_POD, UNLABELED_POD):
        assert not ingress_allowed(rendered, rendered.pod_labels(target), port, _ports(rendered, target), peer)
    service = rendered.get("Service", "console")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert rendered.get("PodDisruptionBudget", "console")["spec"]["minAvailable"] == 1


# ---------------------------------------------------------------- connection budget

# The dev overlay's PostgreSQL (postgres:16 with its defaults): max_connections 100, 3 superuser slots.
DEV_POSTGRES_ALLOWS = 100 - 3


def _most_replicas(r: Rendered, name: str) -> int:
    """What Kubernetes may run of ``name`` at most: its HPA's maxReplicas, else its Deployment's replicas."""
    hpa = r.find("HorizontalPodAutoscaler", name)
    if hpa is not None:
        return int(hpa["spec"]["maxReplicas"])
    return int(r.get("Deployment", name)["spec"].get("replicas", 1))


def test_the_connection_budget_covers_every_replica_kubernetes_may_run(overlay: str, rendered: Rendered) -> None:
    """Each database service reads the same budget; its replica maxima are the HPAs' (or the replica
    counts); the total fits the dev PostgreSQL, and is the figure docs/operations.md gives for prod."""
    budgets = set()
    for name in WITH_DATABASE:
        env = effective_env(rendered, app_container(rendered, name))
        budgets.add(ConnectionBudget.from_env({k: v for k, v in env.items() if isinstance(v, str)}))
    assert len(budgets) == 1, budgets
    budget = budgets.pop()
    for name, replicas, _pool in budget.shares:
        assert replicas == _most_replicas(rendered, name), (name, replicas, budget.explain())
    assert "max_connections" not in (K8S / "overlays" / "dev" / "postgres.yaml").read_text()
    if overlay == "dev":
        assert budget.total <= DEV_POSTGRES_ALLOWS, budget.explain()
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert f"| `{overlay}` | {budget.explain()} |" in operations, budget.explain()


def test_the_image_exposes_every_port_a_service_of_ours_listens_on() -> None:
    """Issue 49: the Dockerfile's EXPOSE names every containerPort of a container running our image."""
    exposed = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("EXPOSE "):
            exposed |= {int(p) for p in line.split()[1:]}
    ours = set()
    for manifest in sorted((ROOT / "deploy" / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            for container in spec.get("containers", []):
                if container.get("image") == "quayutec":
                    ours |= {p["containerPort"] for p in container.get("ports", [])}
    assert {50051, 50052, 50053, 50054, 50055, 8080} <= ours  # the manifests were read
    assert ours - exposed == set()
