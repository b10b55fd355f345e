"""The Helm chart (deploy/helm/nixl-twisted), rendered by the real helm and
checked by the real kubernetes-validate, with its defaults and with every part
on; the plain manifests held equal to the defaults' rendering; and what the
chart passes the proxy (its flags, its TOML file, its secrets) read by the
proxy's own option parser, so that a renamed option breaks this test, not a
user's deployment. ``make chart-check`` fetches both tools (``make helm``,
``make kubernetes-validate``); without them this skips, with CI set it fails.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

import nixl_twisted
from nixl_twisted.config.settings import SETTINGS
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.run.proxy_service import CLOSE_GRACE
from nixl_twisted.tap import Options
from tests.loopback.test_tls import self_signed

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "nixl-twisted"
MANIFESTS = ROOT / "deploy" / "kubernetes" / "nixl-twisted.yaml"
EVERYTHING_ON = CHART / "ci" / "everything-on-values.yaml"
REDIS_ON = CHART / "ci" / "redis-values.yaml"
VALUES = {"defaults": None, "everything-on": EVERYTHING_ON, "redis": REDIS_ON}
TOOLS = Path.home() / ".cache" / "nixl-twisted"
#: What kubernetes-validate has no schema for: Prometheus Operator's resource and
#: KEDA's, checked field by field below instead.
NO_SCHEMA = {"ServiceMonitor", "ScaledObject"}
#: The oldest Kubernetes the chart says it runs on (Chart.yaml's kubeVersion),
#: and the newest kubernetes-validate knows.
KUBERNETES = ("1.25", "1.37")


def tool(variable: str, default: Path, target: str) -> str:
    """The tool's path: ``$variable``, else where ``make target`` puts it."""
    path = os.environ.get(variable) or str(default)
    if not os.access(path, os.X_OK):
        missing = f"{path} is missing: make {target}"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return path


def helm() -> str:
    return tool("HELM", TOOLS / "helm-v4.1.4" / "helm", "helm")


@cache
def _render(helm: str, values: Path | None) -> str:
    command = [helm, "template", "nixlproxy", str(CHART), "--namespace", "serving"]
    if values is not None:
        command += ["--values", str(values)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered(name: str) -> str:
    return _render(helm(), VALUES[name])


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc


def proxy_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The proxy's Deployment (with redis.enabled, the chart's Redis is another)."""
    (proxy,) = [
        d for d in by_kind(docs, "Deployment") if not d["metadata"]["name"].endswith("-redis")
    ]
    return proxy


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (proxy,) = proxy_deployment(docs)["spec"]["template"]["spec"]["containers"]
    return proxy


@pytest.mark.parametrize("kubernetes", KUBERNETES)
@pytest.mark.parametrize("name", VALUES)
def test_kubernetes_validate_strict_passes_every_resource_the_chart_renders(
    name: str, kubernetes: str, tmp_path: Path
) -> None:
    validate = tool(
        "KUBERNETES_VALIDATE",
        TOOLS / "kubernetes-validate-1.37.0" / "bin" / "kubernetes-validate",
        "kubernetes-validate",
    )
    text = rendered(name)
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(text)
    done = subprocess.run(
        [validate, "--strict", "--kubernetes-version", kubernetes, str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    kinds = [doc["kind"] for doc in documents(text)]
    passed = re.findall(r"^INFO .* passed for resource (\w+)/", said, re.M)
    assert sorted(passed) == sorted(k.lower() for k in kinds if k not in NO_SCHEMA), said
    unchecked = re.findall(r"^WARN .*Couldn't find schema for kind (\w+)", said, re.M)
    assert set(unchecked) == {k for k in kinds if k in NO_SCHEMA}, said
    assert not re.search(
        r"^(ERROR|WARN)(?!.*Couldn't find schema for kind (ServiceMonitor|ScaledObject) )",
        said,
        re.M,
    )


def test_everything_on_renders_every_template_and_the_defaults_the_hardened_core() -> None:
    on = {doc["kind"] for doc in documents(rendered("everything-on"))}
    assert on == {
        "ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding",
        "Secret", "Service", "ServiceAccount", "ServiceMonitor", "ScaledObject",
    }  # fmt: skip
    defaults = {doc["kind"] for doc in documents(rendered("defaults"))}
    assert defaults == on - {"Secret", "ServiceMonitor", "ScaledObject"}


def test_the_plain_manifests_are_the_chart_rendered_with_its_defaults() -> None:
    assert documents(MANIFESTS.read_text()) == documents(rendered("defaults")), (
        "deploy/kubernetes/ is behind the chart: make manifests"
    )


def test_the_chart_is_the_proxy_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == nixl_twisted.__version__
    assert chart["kubeVersion"] == f">={KUBERNETES[0]}.0-0"


@cache
def twistd_help() -> str:
    """``twistd nixlproxy --help`` of the installed proxy, as a user reads it."""
    twistd = Path(sys.executable).parent / "twistd"
    done = subprocess.run(
        [str(twistd), "nixlproxy", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("name", VALUES)
def test_every_flag_the_chart_passes_is_in_twistd_nixlproxy_help(name: str) -> None:
    flags = [arg for arg in container(documents(rendered(name)))["args"] if arg.startswith("--")]
    assert "--config" in flags
    missing = [flag for flag in flags if not re.search(rf"{flag}\b", twistd_help())]
    assert not missing, f"the chart passes options twistd nixlproxy does not have: {missing}"


@pytest.mark.parametrize("name", VALUES)
def test_the_proxy_reads_the_chart_s_flags_file_and_secrets_as_one_configuration(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = documents(rendered(name))
    proxy = container(docs)
    config_map = next(d for d in by_kind(docs, "ConfigMap") if "nixlproxy.toml" in d["data"])
    certificate, key = self_signed(tmp_path)
    mounted = {  # where the pod has each file, and where this test writes it
        "/etc/nixlproxy/nixlproxy.toml": tmp_path / "nixlproxy.toml",
        "/etc/nixlproxy/keys/api-keys-file": tmp_path / "api-keys-file",
        "/etc/nixlproxy/tls/tls.crt": certificate,
        "/etc/nixlproxy/tls/tls.key": key,
    }
    mounted["/etc/nixlproxy/nixlproxy.toml"].write_text(config_map["data"]["nixlproxy.toml"])
    mounted["/etc/nixlproxy/keys/api-keys-file"].write_text("sk-from-the-file team-c\n")
    args = []
    for arg in proxy["args"]:
        for path, here in mounted.items():
            arg = arg.replace(path, str(here))
        args.append(arg)
    secrets = {s["metadata"]["name"]: secret_data(s) for s in by_kind(docs, "Secret")}
    environment: dict[str, str] = {}
    for variable in proxy.get("env", []):
        ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None and ref["key"] in secrets.get(ref["name"], {}):
            environment[variable["name"]] = secrets[ref["name"]][ref["key"]]
        elif ref is None:  # $(NAME): an earlier variable, as the kubelet puts it in
            value = re.sub(r"\$\((\w+)\)", lambda m: environment[m[1]], variable["value"])
            environment[variable["name"]] = value
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    options = Options()
    options.parseOptions(args)
    config = options.config
    assert config is not None
    assert config.discovery.selector("prefill") == "app=vllm,role=prefill"
    assert config.discovery.selector("decode") == "app=vllm,role=decode"
    assert config.admin_listen is not None and config.admin_listen not in config.listen
    if name == "everything-on":
        tenants = {row[0]: row for row in config.tenants.table}
        assert tenants["trial"][2] == 20  # requests a minute: a TOML table, whole numbers
        assert config.admin_token == "an-admin-token"
    if name == "redis":  # the chart's Redis, its password from its Secret
        assert (
            config.replicas.redis == "redis://:a-redis-password@nixlproxy-nixl-twisted-redis:6379/0"
        )
    grace = proxy_deployment(docs)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain = config.timeouts.shutdown_delay + config.timeouts.drain + CLOSE_GRACE
    assert drain < grace <= drain + 10, "SIGKILL before the drain can end, or long after"


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    """A Secret's values, whether written as stringData or (base64) data."""
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return {**data, **secret.get("stringData", {})}


@pytest.mark.parametrize("name", VALUES)
def test_the_service_is_for_clients_and_the_admin_port_is_on_the_pods_alone(name: str) -> None:
    docs = documents(rendered(name))
    proxy = container(docs)
    ports = {port["name"]: port["containerPort"] for port in proxy["ports"]}
    assert set(ports) == {"http", "admin", "metrics"}
    services = {s["metadata"]["name"]: s["spec"] for s in by_kind(docs, "Service")}
    client = services.pop("nixlproxy-nixl-twisted")
    services.pop("nixlproxy-nixl-twisted-redis", None)  # (the chart's Redis: its own pods)
    assert [p["targetPort"] for p in client["ports"]] == ["http"]
    for spec in services.values():  # the ServiceMonitor's, when on: metrics alone
        assert spec["clusterIP"] == "None"
        assert [p["targetPort"] for p in spec["ports"]] == ["metrics"]
    assert not any("admin" in str(s["ports"]) for s in [client, *services.values()])
    assert f"tcp:{ports['admin']}" in proxy["args"]
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/health"
    assert proxy["livenessProbe"] == {**proxy["livenessProbe"], "tcpSocket": {"port": "admin"}}


@pytest.mark.parametrize("name", VALUES)
def test_the_pods_run_hardened_and_may_only_list_and_watch_pods(name: str) -> None:
    docs = documents(rendered(name))
    pod = proxy_deployment(docs)["spec"]["template"]["spec"]
    proxy = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert proxy["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert proxy["resources"]["requests"] and proxy["resources"]["limits"]["memory"]
    assert not any(arg.startswith(("sk-", "an-admin")) for arg in proxy["args"])
    role, binding = one(docs, "Role"), one(docs, "RoleBinding")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = one(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "serving"}
    ]
    assert pod["serviceAccountName"] == account
    budget = one(docs, "PodDisruptionBudget")["spec"]
    assert budget["selector"]["matchLabels"] == pod_labels(docs)


def pod_labels(docs: list[dict[str, Any]]) -> dict[str, str]:
    selector: dict[str, str] = proxy_deployment(docs)["spec"]["selector"]["matchLabels"]
    return selector


def test_the_service_monitor_scrapes_the_metrics_service_and_grafana_gets_the_dashboard() -> None:
    docs = documents(rendered("everything-on"))
    monitor = one(docs, "ServiceMonitor")
    (metrics,) = [s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert metrics["spec"]["selector"] == pod_labels(docs)
    (dashboard,) = [d for d in by_kind(docs, "ConfigMap") if "nixlproxy.json" in d["data"]]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    assert json.loads(dashboard["data"]["nixlproxy.json"]) == shipped


#: KEDA's ScaledObject (keda.sh/v1alpha1) and its Prometheus trigger: the fields they have.
SCALED_OBJECT_SPEC = {
    "scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
    "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "advanced", "fallback", "triggers",
}  # fmt: skip
TRIGGER = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}
PROMETHEUS_METADATA = {
    "serverAddress", "query", "threshold", "activationThreshold", "namespace",
    "customHeaders", "ignoreNullValues", "unsafeSsl", "queryParameters", "timeout",
}  # fmt: skip


def test_keda_scales_each_vllm_pool_by_the_saturation_the_proxies_export() -> None:
    docs = documents(rendered("everything-on"))
    scaled = {doc["metadata"]["name"]: doc for doc in by_kind(docs, "ScaledObject")}
    assert set(scaled) == {"vllm-prefill", "vllm-decode", "vllm-decode-llama-70b"}
    (monitored,) = [s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    exported = {family.name for family in ProxyMetrics().registry.collect()}
    for name, doc in scaled.items():
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        spec = doc["spec"]
        assert set(spec) <= SCALED_OBJECT_SPEC, set(spec) - SCALED_OBJECT_SPEC
        assert spec["scaleTargetRef"] == {"name": name}
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert set(trigger) <= TRIGGER and set(trigger["metadata"]) <= PROMETHEUS_METADATA
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "Value")
        metadata = trigger["metadata"]
        # KEDA reads every metadata value as a string.
        assert all(isinstance(value, str) for value in metadata.values()), metadata
        assert 0 < float(metadata["threshold"]) <= 1
        query = metadata["query"]
        asked = re.findall(r"(nixlproxy_[a-z_]+)\{([^}]*)\}", query)
        assert {metric for metric, _ in asked} == {
            "nixlproxy_pool_slots_in_use",
            "nixlproxy_pool_queued",
            "nixlproxy_pool_slots",
        }
        assert {metric for metric, _ in asked} <= exported
        pool = "prefill" if "prefill" in name else "decode"
        for _, matchers in asked:  # the series of this release's proxies, of this pool
            said = dict(re.findall(r'(\w+)="([^"]*)"', matchers))
            assert said["job"] == monitored["metadata"]["name"]
            assert said["namespace"] == "serving" and said["pool"] == pool
            assert said.get("model") == ("llama-70b" if name.endswith("70b") else None)


def helm_run(*args: str) -> subprocess.CompletedProcess[str]:
    """``helm ARGS`` on the chart, as the release nixlproxy in the namespace serving."""
    command = [helm(), *args[:1], "nixlproxy", str(CHART), "--namespace", "serving", *args[1:]]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def rendered_with(*sets: str) -> list[dict[str, Any]]:
    done = helm_run("template", *[arg for s in sets for arg in ("--set", s)])
    assert done.returncode == 0, done.stderr
    return documents(done.stdout)


def notes(*sets: str) -> str:
    """What ``helm install`` prints after it (NOTES.txt), rendered without a cluster."""
    done = helm_run("install", "--dry-run=client", *[arg for s in sets for arg in ("--set", s)])
    assert done.returncode == 0, done.stderr
    return done.stdout.partition("\nNOTES:\n")[2]


def test_the_notes_warn_of_replicas_without_a_redis_to_share() -> None:
    warned = notes()  # the defaults: two replicas, no Redis
    assert "WARNING: 2 replicas and no Redis to share" in warned
    assert "--set redis.enabled=true" in warned
    for shared in (
        ["redis.enabled=true"],
        ["secrets.replicasRedis=redis://redis.serving:6379/1"],
        ["replicaCount=1"],
    ):
        assert "WARNING" not in notes(*shared), shared


def test_a_new_secret_rolls_the_pods_as_a_new_configuration_does() -> None:
    def annotations(*sets: str) -> dict[str, str]:
        pod = proxy_deployment(rendered_with(*sets))["spec"]["template"]["metadata"]
        found: dict[str, str] = pod["annotations"]
        return found

    first = annotations("secrets.adminToken=one")
    second = annotations("secrets.adminToken=two")
    assert first["checksum/config"] == second["checksum/config"]
    assert first["checksum/secret"] != second["checksum/secret"]
    assert "checksum/secret" not in annotations()  # (no Secret of the chart's: none)
    redis = [annotations("redis.enabled=true", f"redis.password={p}") for p in ("a", "b")]
    assert redis[0]["checksum/redis-secret"] != redis[1]["checksum/redis-secret"]


def test_one_value_runs_replicas_sharing_the_charts_own_redis() -> None:
    docs = documents(rendered("redis"))
    redis = {d["kind"]: d for d in docs if d["metadata"]["name"] == "nixlproxy-nixl-twisted-redis"}
    assert set(redis) == {"Deployment", "Service", "Secret"}
    pod = redis["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert redis["Service"]["spec"]["selector"].items() <= labels.items()
    # The proxy's Service, Deployment and budget select the proxy's pods, never Redis's.
    assert not pod_labels(docs).items() <= labels.items()
    (server,) = pod["spec"]["containers"]
    assert server["args"][:3] == ["redis-server", "--requirepass", "$(REDIS_PASSWORD)"]
    assert "a-redis-password" not in json.dumps(pod) + json.dumps(proxy_deployment(docs))
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    assert redis["Deployment"]["spec"]["replicas"] == 1
    assert not any(
        d["metadata"]["name"].endswith("-redis")
        for d in by_kind(documents(rendered("defaults")), "Deployment")
    )
    both = helm_run(
        "template", "--set", "redis.enabled=true", "--set", "secrets.replicasRedis=redis://r:6379"
    )
    assert both.returncode != 0
    assert "redis.enabled and secrets.replicasRedis both name the replicas' Redis" in both.stderr


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("config.decode-max-in-flight=abc", "at '/config/decode-max-in-flight': 'abc' does not"),
        ("config.decode-max-inflight=4", "additional properties 'decode-max-inflight' not allowed"),
        ("config.prefill-policy=fastest", "at '/config/prefill-policy'"),
        ("config.drain-timeout=60", "additional properties 'drain-timeout' not allowed"),
        ("replicaCount=two", "at '/replicaCount'"),
        ("redis.password=p@ss", "at '/redis/password'"),
        ("shutdownDelay=-1", "at '/shutdownDelay'"),
    ],
)  # fmt: skip
def test_values_the_proxy_would_refuse_fail_at_render_naming_the_value(
    value: str, said: str
) -> None:
    """Not a pod that crash-loops on its configuration: helm says which value, at once."""
    done = helm_run("template", "--set", value)
    assert done.returncode != 0
    assert said in done.stderr, done.stderr


def values_schema() -> Any:
    spec = importlib.util.spec_from_file_location(
        "values_schema", ROOT / "deploy" / "helm" / "values_schema.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_values_schema_is_made_from_the_proxy_s_settings() -> None:
    made = values_schema()
    assert (CHART / "values.schema.json").read_text() == made.render(), (
        "values.schema.json is behind the settings table: make chart-schema"
    )
    config = json.loads(made.render())["properties"]["config"]["properties"]
    assert set(config) | set(made.SET_BY_THE_CHART) == {s.name for s in SETTINGS}
    # Every setting the proxy reads is typed here, but those the chart sets itself.
    assert config["decode-max-in-flight"]["minimum"] == 0
    assert config["prefill-policy"]["enum"][0] == "round-robin"


def test_the_replicas_spread_over_nodes_by_default_softly() -> None:
    def spread(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = proxy_deployment(docs)["spec"]["template"]["spec"].get(
            "topologySpreadConstraints", []
        )
        return found

    (soft,) = spread(documents(rendered("defaults")))
    assert soft == {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": pod_labels(documents(rendered("defaults")))},
    }
    everything = spread(documents(rendered("everything-on")))  # its own zone spread besides
    assert [c["topologyKey"] for c in everything] == [
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    ]
    assert spread(rendered_with("topologySpread.enabled=false")) == []
