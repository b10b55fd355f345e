"""Discovery's rules, with no network: grammar, grace, the guard, refresh times, pods."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from twisted.names import dns
from twisted.names.error import DNSNameError, DNSServerError
from zope.interface import provider

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.sources import ConfigError
from nixl_twisted.config.values import InvalidValue, label_selector, pool_member
from nixl_twisted.discovery import kubeconfig
from nixl_twisted.discovery.dns import DnsSource
from nixl_twisted.discovery.kubernetes import Gone, KubernetesSource, instance_url
from nixl_twisted.discovery.membership import Membership

Applied = list[tuple[str, str, tuple[str, ...]]]


@pytest.mark.parametrize(
    ("member", "normal"),
    [
        ("dns+http://vllm-prefill.ns.svc:8100", "dns+http://vllm-prefill.ns.svc:8100"),
        ("dns+http://decode.test:8200/v/#dp=2", "dns+http://decode.test:8200/v#dp=2"),
        ("dnssrv+http://_http._tcp.decode.test", "dnssrv+http://_http._tcp.decode.test"),
        ("http://10.0.0.1:8100", "http://10.0.0.1:8100"),
    ],
)
def test_dns_members_are_normalized_like_urls(member: str, normal: str) -> None:
    assert pool_member(member) == normal


@pytest.mark.parametrize(
    ("member", "why"),
    [
        ("dns+http://decode.test", "needs the instances' port"),
        ("dnssrv+http://_http._tcp.decode.test:8200", "from its SRV record"),
        ("dns+http://10.0.0.1:8200", "needs a DNS name"),
        ("dns+ftp://decode.test:8200", "http:// or https://"),
    ],
)
def test_unusable_dns_members_say_why(member: str, why: str) -> None:
    with pytest.raises(InvalidValue, match=why):
        pool_member(member)


@pytest.mark.parametrize(
    "selector", ["app=vllm", "app=vllm,role=prefill", "role in (a, b),!canary", "tier!=x,env"]
)
def test_label_selectors_kubectl_takes_are_taken(selector: str) -> None:
    assert label_selector(selector) == selector


@pytest.mark.parametrize("selector", ["", "app=vllm role=x", "=x", "a in b", "app=(x)"])
def test_broken_label_selectors_are_refused(selector: str) -> None:
    with pytest.raises(InvalidValue):
        label_selector(selector)


def test_a_pool_may_be_a_selector_alone_but_not_nothing() -> None:
    config = ProxyConfig.create(prefill_selector="app=vllm,role=prefill", decode=["http://d:1"])
    assert config.pools.prefill == () and config.discovery.selector("prefill")
    with pytest.raises(ConfigError, match="--prefill-selector"):
        ProxyConfig.create(decode=["http://d:1"])
    with pytest.raises(ConfigError, match="dns-min-refresh"):
        ProxyConfig.create(
            prefill=["http://p:1"], decode=["http://d:1"], dns_min_refresh=60, dns_max_refresh=30
        )


def membership(
    grace: float = 10, allowed: tuple[str, ...] = ()
) -> tuple[Membership, Applied, Clock]:
    clock = Clock()
    applied: Applied = []
    found = Membership(
        clock,
        lambda role, source, urls, retire: applied.append((role, source, urls)),
        grace,
        AllowedBackends(allowed),
    )
    found.add("decode", "dns+http://d.test:1")
    return found, applied, clock


def test_an_empty_answer_empties_only_after_the_grace() -> None:
    found, applied, clock = membership(grace=10)
    found.found("decode", "dns+http://d.test:1", ["http://10.0.0.1:1"])
    found.found("decode", "dns+http://d.test:1", [])
    clock.advance(9.9)
    assert applied == [("decode", "dns+http://d.test:1", ("http://10.0.0.1:1",))]
    assert found.status()[0]["state"] == "emptying"
    clock.advance(0.1)
    assert applied[-1] == ("decode", "dns+http://d.test:1", ())
    assert found.status()[0]["state"] == "empty"


def test_a_discovered_instance_whose_kv_events_are_outside_the_guard_is_left_out() -> None:
    found, applied, _ = membership(allowed=("10.0.0.0/8",))
    kept = "http://10.0.0.2:1#kv-events=tcp://10.0.0.9:5557"
    found.found(
        "decode", "dns+http://d.test:1", ["http://10.0.0.1:1#kv-events=tcp://8.8.8.8:1", kept]
    )
    assert applied == [("decode", "dns+http://d.test:1", (kept,))]


def test_an_answer_within_the_grace_keeps_the_instances() -> None:
    found, applied, clock = membership(grace=10)
    found.found("decode", "dns+http://d.test:1", ["http://10.0.0.1:1"])
    found.found("decode", "dns+http://d.test:1", [])
    found.found("decode", "dns+http://d.test:1", ["http://10.0.0.1:1"])
    clock.advance(60)
    assert applied == [("decode", "dns+http://d.test:1", ("http://10.0.0.1:1",))]
    assert found.status()[0]["state"] == "ok"


def test_failures_never_empty_and_are_counted() -> None:
    found, applied, clock = membership(grace=1)
    errors: list[tuple[str, str]] = []
    found.on_error = lambda *said: errors.append(said)
    found.found("decode", "dns+http://d.test:1", ["http://10.0.0.1:1"])
    for _ in range(3):
        found.failed("decode", "dns+http://d.test:1", "timed out")
        clock.advance(60)
    assert len(applied) == 1
    assert errors == [("decode", "dns")] * 3
    assert found.status()[0] | {"name": None} == {
        "pool": "decode",
        "source": "dns",
        "name": None,
        "state": "failing",
        "instances": 1,
        "ignored": 0,
        "errors": 3,
        "last_error": "timed out",
    }


def test_the_guard_leaves_out_what_it_refuses() -> None:
    found, applied, _ = membership(allowed=("10.0.0.0/8",))
    found.found(
        "decode",
        "dns+http://d.test:1",
        ["http://10.0.0.1:1", "http://192.168.1.1:1", "http://169.254.169.254:1"],
    )
    assert applied == [("decode", "dns+http://d.test:1", ("http://10.0.0.1:1",))]


class Answers:
    """A resolver that answers as told, and counts the questions."""

    def __init__(self) -> None:
        self.ttl = 5
        self.outcome: Any = None
        self.asked = 0

    def lookupAddress(self, name: str) -> Deferred[Any]:
        self.asked += 1
        if self.outcome is not None:
            return fail(self.outcome)
        record = dns.RRHeader(name, dns.A, ttl=self.ttl, payload=dns.Record_A("10.0.0.1"))
        return succeed(([record], [], []))

    def lookupIPV6Address(self, name: str) -> Deferred[Any]:
        if self.outcome is not None:
            return fail(self.outcome)
        return succeed(([], [], []))


def source(least: float = 1, most: float = 30) -> tuple[DnsSource, Answers, Clock, Applied]:
    clock, answers, applied = Clock(), Answers(), []
    found = Membership(
        clock, lambda role, source, urls, retire: applied.append((role, source, urls)), 10
    )
    dns_source = DnsSource("decode", "dns+http://d.test:8200", answers, clock, found, (least, most))
    return dns_source, answers, clock, applied


@pytest.mark.parametrize(("ttl", "next_ask"), [(5, 5), (0, 1), (3600, 30)])
def test_a_name_is_asked_again_when_its_ttl_runs_out_within_bounds(
    ttl: int, next_ask: float
) -> None:
    dns_source, answers, clock, applied = source()
    answers.ttl = ttl
    dns_source.start()
    assert applied == [("decode", "dns+http://d.test:8200", ("http://10.0.0.1:8200",))]
    clock.advance(next_ask - 0.01)
    assert answers.asked == 1
    clock.advance(0.01)
    assert answers.asked == 2
    dns_source.stop()
    assert clock.getDelayedCalls() == []


def test_failures_back_off_from_the_least_to_the_most_interval() -> None:
    dns_source, answers, clock, _ = source(least=1, most=8)
    answers.outcome = DNSServerError("SERVFAIL")
    dns_source.start()
    waits = []
    for _ in range(5):
        (call,) = clock.getDelayedCalls()
        waits.append(call.getTime() - clock.seconds())
        clock.advance(waits[-1])
    assert waits == [1, 2, 4, 8, 8]
    answers.outcome = DNSNameError("NXDOMAIN")  # authoritative: not a failure
    dns_source.stop()


def pod(**changes: Any) -> dict[str, Any]:
    made: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ns", "resourceVersion": "7"},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8100}]}]},
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    for path, value in changes.items():
        where = made
        *parents, last = path.split("__")
        for parent in parents:
            where = where[parent]
        where[last] = value
    return made


@pytest.mark.parametrize(
    ("changes", "port", "url"),
    [
        ({}, "8000", "http://10.1.2.3:8000"),
        ({}, "http", "http://10.1.2.3:8100"),
        ({}, "grpc", None),  # no such port on the pod
        ({"status__podIP": "fd00::5"}, "8000", "http://[fd00::5]:8000"),
        ({"status__conditions": [{"type": "Ready", "status": "False"}]}, "8000", None),
        ({"status__phase": "Pending"}, "8000", None),
        ({"status__podIP": None}, "8000", None),
        ({"metadata__deletionTimestamp": "2026-12-05T08:00:00Z"}, "8000", None),
    ],
)
def test_a_pod_is_an_instance_while_ready_with_an_ip_and_not_terminating(
    changes: dict[str, Any], port: str, url: str | None
) -> None:
    assert instance_url(pod(**changes), port) == url


def test_a_kubeconfig_gives_the_current_context(tmp_path: Any) -> None:
    (tmp_path / "ca.pem").write_text("CA")
    (tmp_path / "config").write_text(
        """
apiVersion: v1
kind: Config
current-context: here
contexts:
- name: here
  context: {cluster: c, user: u, namespace: serving}
- name: there
  context: {cluster: other, user: u}
clusters:
- name: c
  cluster: {server: "https://k8s.example:6443/", certificate-authority: ca.pem}
users:
- name: u
  user: {token: secret}
"""
    )
    access = kubeconfig.from_kubeconfig(str(tmp_path / "config"))
    assert access.server == "https://k8s.example:6443"
    assert access.ca == "CA"
    assert access.authorization() == "Bearer secret"
    assert kubeconfig.namespace(None, str(tmp_path / "config"), {}) == "serving"
    assert kubeconfig.namespace("mine", str(tmp_path / "config"), {}) == "mine"


def test_a_kubeconfig_that_needs_a_plugin_says_so(tmp_path: Any) -> None:
    (tmp_path / "config").write_text(
        "current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "clusters: [{name: c, cluster: {server: 'https://k'}}]\n"
        "users: [{name: u, user: {exec: {command: aws}}}]\n"
    )
    with pytest.raises(kubeconfig.NoApiAccess, match="plugin"):
        kubeconfig.from_kubeconfig(str(tmp_path / "config"))


def test_in_a_pod_the_service_account_is_used_and_its_token_read_each_time(tmp_path: Any) -> None:
    (tmp_path / "token").write_text("one\n")
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "namespace").write_text("serving")
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    access = kubeconfig.in_cluster(environ, tmp_path)
    assert access is not None
    assert (access.server, access.namespace, access.ca) == (
        "https://10.96.0.1:443",
        "serving",
        "CA",
    )
    assert access.authorization() == "Bearer one"
    (tmp_path / "token").write_text("two\n")  # rotated
    assert access.authorization() == "Bearer two"
    assert kubeconfig.in_cluster({}, tmp_path) is None
    with pytest.raises(kubeconfig.NoApiAccess, match="--kubeconfig"):
        kubeconfig.access(None, {})


def test_watch_events_move_the_pods_and_the_version_and_410_means_list_again() -> None:
    clock, applied = Clock(), []
    found = Membership(
        clock, lambda role, source, urls, retire: applied.append((role, source, urls)), grace=0
    )
    config = ProxyConfig.create(
        prefill=["http://p:1"], decode_selector="app=x", kubernetes_namespace="ns"
    )
    source = KubernetesSource("decode", "kubernetes:ns/app=x", config.discovery, None, clock, found)
    found.add("decode", "kubernetes:ns/app=x")
    source._event({"type": "ADDED", "object": pod()})
    assert applied == [("decode", "kubernetes:ns/app=x", ("http://10.1.2.3:8000",))]
    bookmark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "12"}}
    source._event({"type": "BOOKMARK", "object": bookmark})
    assert source.version == "12" and len(applied) == 1
    source._event({"type": "DELETED", "object": pod()})
    assert applied[-1] == ("decode", "kubernetes:ns/app=x", ())
    with pytest.raises(Gone):
        source._event({"type": "ERROR", "object": {"kind": "Status", "code": 410}})


def test_the_plain_manifests_grant_list_and_watch_only_and_configure_a_proxy(
    tmp_path: Path,
) -> None:
    """deploy/kubernetes/ (the chart's defaults, rendered): what a user without Helm applies."""
    import yaml

    from nixl_twisted.tap import Options

    manifests = Path(__file__).parents[2] / "deploy" / "kubernetes" / "nixl-twisted.yaml"
    documents = {doc["kind"]: doc for doc in yaml.safe_load_all(manifests.read_text()) if doc}
    role, binding = documents["Role"], documents["RoleBinding"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    account = documents["ServiceAccount"]["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": "serving"}
    ]
    pod = documents["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["name"]
    assert pod["automountServiceAccountToken"] is True  # discovery's token
    args = pod["containers"][0]["args"]
    toml = tmp_path / "nixlproxy.toml"
    toml.write_text(documents["ConfigMap"]["data"]["nixlproxy.toml"])
    options = Options()
    options.parseOptions([str(toml) if arg.endswith("nixlproxy.toml") else arg for arg in args])
    config = options.config
    assert config is not None
    assert config.discovery.selector("prefill") == "app=vllm,role=prefill"
    assert config.discovery.selector("decode") == "app=vllm,role=decode"
    assert config.discovery.port == "http"


def test_a_failure_does_not_stop_a_grace_already_running() -> None:
    found, applied, clock = membership(grace=10)
    found.found("decode", "dns+http://d.test:1", ["http://10.0.0.1:1"])
    found.found("decode", "dns+http://d.test:1", [])
    found.failed("decode", "dns+http://d.test:1", "timed out")
    clock.advance(10)
    assert applied[-1] == ("decode", "dns+http://d.test:1", ())


def test_failures_are_counted_for_good_even_once_their_source_is_forgotten() -> None:
    found, _, _ = membership()
    found.failed("decode", "dns+http://d.test:1", "timed out")
    found.forget("decode", "dns+http://d.test:1")
    assert found.counted() == [{"pool": "decode", "source": "dns", "errors": 1}]
    assert found.status() == []


def test_a_new_allowed_list_applies_to_what_each_source_last_answered() -> None:
    found, applied, _ = membership(allowed=("10.0.0.0/8",))
    urls = ["http://10.0.0.1:1", "http://192.168.0.1:1"]
    found.found("decode", "dns+http://d.test:1", urls)
    found.use_allowed(AllowedBackends(("10.0.0.0/8", "192.168.0.0/16")))
    assert applied[-1] == ("decode", "dns+http://d.test:1", tuple(urls))


def test_a_pool_takes_the_first_discovered_instances_up_to_the_cap_and_says_so_once(
    cap_lines: list[str],
) -> None:
    clock, applied = Clock(), dict[str, tuple[str, ...]]()
    found = Membership(
        clock, lambda role, source, urls, retire: applied.__setitem__(source, urls), most=4
    )
    a, b = "dns+http://a.test:1", "dns+http://b.test:1"
    found.add("decode", b)
    found.add("decode", a)
    many = [f"http://10.0.0.{i}:1" for i in (9, 1, 5, 3)]
    for _ in range(3):  # every refresh lists the same: said once
        found.found("decode", b, ["http://10.0.1.1:1", "http://10.0.0.1:1"])
        found.found("decode", a, many)
    # The first four by source (a before b), then URL; b's 10.0.0.1 is a's already.
    assert applied == {
        a: ("http://10.0.0.1:1", "http://10.0.0.3:1", "http://10.0.0.5:1", "http://10.0.0.9:1"),
        b: ("http://10.0.0.1:1",),
    }
    assert [(s["name"], s["instances"], s["ignored"]) for s in found.status()] == [
        (b, 1, 1),
        (a, 4, 0),
    ]
    assert cap_lines == [
        "decode: discovery lists 5 instances, more than --discovery-max-instances (4): "
        "the first 4 by source and URL are used, 1 ignored"
    ]

    found.found("decode", a, many[:3])  # room again: b's other one joins
    assert applied[b] == ("http://10.0.0.1:1", "http://10.0.1.1:1")
    assert cap_lines[1:] == [
        "decode: every discovered instance is used again (--discovery-max-instances 4)"
    ]
    found.use_most(2)  # a reload lowers the cap
    assert applied == {a: ("http://10.0.0.1:1", "http://10.0.0.5:1"), b: ("http://10.0.0.1:1",)}
    found.forget("decode", a)  # a source gone makes room for the others
    assert applied[b] == ("http://10.0.0.1:1", "http://10.0.1.1:1")


@pytest.fixture
def cap_lines() -> Iterator[list[str]]:
    lines: list[str] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        if "discovery-max-instances" in formatEvent(event):
            lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


def test_the_cap_is_an_option_with_a_default() -> None:
    config = ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"])
    assert config.discovery.max_instances == 256
    config = ProxyConfig.create(
        prefill=["http://p:1"], decode=["http://d:1"], discovery_max_instances=3
    )
    assert config.discovery.max_instances == 3
    with pytest.raises(ConfigError, match="discovery-max-instances"):
        ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"], discovery_max_instances=0)
