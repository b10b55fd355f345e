"""What the supervisor and its workers tell each other, without processes."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from nixl_twisted.backends.checks import HealthChecks
from nixl_twisted.backends.health import State, Thresholds
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.service import BackendService
from nixl_twisted.backends.upstream import Upstream
from nixl_twisted.config import Pools, ProxyConfig
from nixl_twisted.run.coordination import Coordinator, Lines, SupervisorLink, encode

P, D1, D2 = "http://p:1", "http://d1:1", "http://d2:1"


class FakeAgent:
    def request(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no backend call in these tests")


def backends(checked: bool = True) -> BackendService:
    clock = Clock()
    thresholds = Thresholds(unhealthy=2, healthy=1)
    config = ProxyConfig.create(
        prefill=[P], decode=[D1], health_interval=0, unhealthy_threshold=2, healthy_threshold=1
    )
    return BackendService(
        BackendPool("prefill", [P], clock, thresholds, checked),
        BackendPool("decode", [D1], clock, thresholds, checked),
        Upstream(FakeAgent()),  # type: ignore[arg-type]
        config,
    )


class Peer:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def supervisor() -> tuple[Coordinator, Peer, Peer]:
    first, second = Peer(), Peer()
    pools = backends()
    config = ProxyConfig.create(prefill=[P], decode=[D1], health_interval=0)
    checks = HealthChecks(pools.pools(), Upstream(FakeAgent()), Clock(), config)  # type: ignore[arg-type]
    return Coordinator(pools, checks, lambda: [first, second]), first, second


def newest_sent(coordinator: Coordinator) -> list[dict[str, Any]]:
    """What a worker started now is told first."""
    newest = Peer()
    coordinator.welcome(newest)
    return newest.sent


def test_lines_cut_a_stream_into_messages_whatever_the_chunks() -> None:
    got: list[dict[str, Any]] = []
    lines = Lines(got.append)
    stream = encode({"a": 1}) + b"not json\n" + encode({"b": [2]})
    for i in range(0, len(stream), 3):
        lines.feed(stream[i : i + 3])
    assert got == [{"a": 1}, {"b": [2]}]


def test_outcomes_from_any_worker_count_together_and_the_verdict_goes_to_all() -> None:
    coordinator, first, second = supervisor()
    (decode,) = coordinator.backends.decode.instances
    coordinator.backends.decode.record_success(decode)  # pending -> up
    first.sent.clear()
    second.sent.clear()
    coordinator.received(first, {"outcome": {"pool": "decode", "url": D1, "failure": "refused"}})
    coordinator.received(second, {"outcome": {"pool": "decode", "url": D1, "failure": "refused"}})
    assert decode.state is State.DOWN  # two in a row, from two workers
    for peer in (first, second):
        assert peer.sent[-1]["health"][0]["state"] == "down"
        assert peer.sent[-1]["health"][0]["url"] == D1


def test_a_change_is_applied_copied_to_the_others_then_confirmed_to_its_origin() -> None:
    coordinator, first, second = supervisor()
    change = {"op": "add", "pool": "decode", "url": D2}
    coordinator.received(first, {"change": change, "id": 7})
    assert coordinator.pools() == Pools((P,), (D1, D2))  # what a restarted worker gets
    assert second.sent == [{"change": change}]
    assert first.sent == [{"done": 7}]


def test_a_new_worker_is_told_every_instance_health() -> None:
    coordinator, first, _ = supervisor()
    coordinator.welcome(first)
    ((message,),) = [first.sent]
    assert [(h["pool"], h["url"], h["state"]) for h in message["health"]] == [
        ("prefill", P, "pending"),
        ("decode", D1, "pending"),
    ]


def test_a_worker_reports_adopts_verdicts_applies_changes_and_waits_for_done() -> None:
    worker = backends()
    applied: list[ProxyConfig] = []
    link = SupervisorLink(None, worker)
    link.on_reloaded(applied.append)
    sent: list[dict[str, Any]] = []
    link._send = sent.append  # type: ignore[method-assign,assignment]
    link.startService = lambda: None  # type: ignore[method-assign]
    for pool in worker.pools():
        pool.report = link.report
    (decode,) = worker.decode.instances

    worker.decode.record_failure(decode, "refused")
    assert sent == [{"outcome": {"pool": "decode", "url": D1, "failure": "refused"}}]
    assert decode.state is State.PENDING  # the supervisor decides

    verdict = dict(decode.health(), state="up")
    link.received({"health": [verdict]})
    assert decode.state is State.UP

    done: list[object] = []
    link.publish({"op": "add", "pool": "decode", "url": D2}).addCallback(done.append)
    assert sent[-1] == {"change": {"op": "add", "pool": "decode", "url": D2}, "id": 1}
    assert done == []
    link.received({"done": 1})
    assert done == [None]

    link.received({"change": {"op": "drain", "pool": "decode", "url": D1}})
    reloaded = ProxyConfig.create(prefill=[P], decode=[D2], prefill_policy="cache-aware")
    link.received({"config": reloaded.to_json()})
    assert applied == [reloaded]  # applied as a SIGHUP's reload is (ProxyService.reconfigure)
    link.received({"config": "{not json"})
    assert applied == [reloaded]  # logged, not applied


def test_what_a_source_lists_goes_to_every_worker_and_to_each_new_one() -> None:
    coordinator, first, second = supervisor()
    source = "dns+http://decode.test:1"
    coordinator.discovered("decode", source, (D2,))
    found = {"pool": "decode", "source": source, "urls": [D2]}
    message = {"discovered": dict(found, retire=False)}
    assert first.sent == second.sent == [message]
    sources = [{"pool": "decode", "source": "dns", "errors": 0}]
    coordinator.sources(sources, [])
    late = Peer()
    coordinator.welcome(late)
    assert late.sent[:2] == [{"discovered": found}, {"sources": sources, "errors": []}]
    # A restarted worker's configuration: the instances given and the names, not the found.
    coordinator.backends.decode.discovered(source, (D2,))
    names = Pools((P,), (D1, "dns+http://decode.test:1"))
    assert coordinator.pools(names) == Pools((P,), (D1, "dns+http://decode.test:1"))
    coordinator.discovered("decode", source, ())
    assert first.sent[-1] == {"discovered": dict(found, urls=[], retire=False)}
    assert [m for m in newest_sent(coordinator) if "sources" in m]  # (unchanged by membership)
    newest = Peer()
    coordinator.welcome(newest)
    assert not [m for m in newest.sent if "discovered" in m]  # the source lists nothing now


def test_a_worker_applies_what_the_supervisor_discovered_and_shows_its_sources() -> None:
    worker = backends(checked=False)
    link = SupervisorLink(None, worker)
    source = "dns+http://decode.test:1"
    link.received({"discovered": {"pool": "decode", "source": source, "urls": [D2]}})
    assert [(i.url, i.source) for i in worker.decode.instances] == [(D1, "static"), (D2, "dns")]
    link.received({"discovered": {"pool": "decode", "source": source, "urls": []}})
    assert [i.url for i in worker.decode.instances] == [D1]  # no leg on it: gone at once
    status = [{"pool": "decode", "source": "dns", "name": source, "errors": 2}]
    errors = [{"pool": "decode", "source": "dns", "errors": 2}]
    link.received({"sources": status, "errors": errors})
    assert (link.told.sources(), link.told.errors()) == (status, errors)


def test_decode_only_tokens_sent_by_the_workers_reach_the_supervisors_health_loop() -> None:
    coordinator, first, _ = supervisor()
    worker = backends()
    link = SupervisorLink(None, worker)
    sent: list[dict[str, Any]] = []
    link._send = sent.append  # type: ignore[method-assign,assignment]
    link.tell_alone()
    assert sent == []  # nothing sent alone: nothing said
    (decode,) = worker.decode.instances
    decode.alone_tokens = 1500.0
    link.tell_alone()
    link.tell_alone()
    assert sent == [{"alone": {D1: 1500.0}}]  # once, then from zero again
    for message in (sent[0], {"alone": {D1: 500.0, "http://gone:1": 9.0}}):
        coordinator.received(first, message)
    (judged,) = coordinator.backends.decode.instances
    assert judged.alone_tokens == 2000.0
