"""One routing view across replicas, without Redis: the messages, and how each side applies them.

What travels (``fleet.messages``) reads back as it was told, and nothing
else does; what another replica sent or predicted is applied without being
told on (so no replica echoes, or applies its own twice); a prediction read
late counts for what is left of its life. The streams themselves and two
proxies sharing them are in ``tests/loopback/test_shared_routes.py``.
"""

from __future__ import annotations

import base64
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock

from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.prefixes import SentPrefixes, pieces
from nixl_twisted.config import ProxyConfig
from nixl_twisted.fleet import messages
from nixl_twisted.fleet.messages import MAX_PIECES, MAX_TOKENS, Predicted, Sent
from nixl_twisted.fleet.outbox import Outbox
from nixl_twisted.fleet.replicas import Replicas
from nixl_twisted.fleet.routes import SharedRoutes
from nixl_twisted.kv.blocks import Stored
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.kv.predictions import PREDICTED_LIFE
from nixl_twisted.observe.replica_metrics import ReplicaMetrics

URL = "http://10.0.0.5:8100"
PROMPT = tuple(range(1000, 1048))  # 3 whole blocks of 16


def told_back(*told: Any, replica: str = "0a1b2c") -> tuple[str, list[Any]]:
    lines = [messages.line(each) for each in told]
    return messages.read(messages.entry(replica, [x for x in lines if x is not None]))


def test_choices_read_back_as_they_were_told() -> None:
    chain = pieces(b"x" * 2000, b"salt")
    sent = Sent("prefill", URL, chain)
    predicted = Predicted("decode", URL, (7, 2**32 - 1, 0), "tenant\ta\n\u00e9")
    bare = Predicted("prefill", URL, PROMPT)
    replica, told = told_back(sent, predicted, bare, replica="000123")
    assert replica == "000123"  # (an id of digits stays text: the entry starts with a letter)
    assert [type(t) for t in told] == [Sent, Predicted, Predicted]
    assert told[0] == sent
    assert (list(told[1].tokens), told[1].salt) == ([7, 2**32 - 1, 0], "tenant\ta\n\u00e9")
    assert (list(told[2].tokens), told[2].salt) == (list(PROMPT), None)


def test_what_is_told_is_bounded_and_what_cannot_be_is_not() -> None:
    long = Predicted("prefill", URL, tuple(range(MAX_TOKENS + 100)))
    (told,) = told_back(long)[1]
    assert len(told.tokens) == MAX_TOKENS  # (the rest is predicted by the replica that chose)
    chain = tuple(range(MAX_PIECES + 5))
    (sent,) = told_back(Sent("prefill", URL, chain))[1]
    assert sent.chain == chain[:MAX_PIECES]
    assert messages.line(Sent("prefill", "http://a\tb", (1,))) is None


def test_a_line_that_is_not_what_a_replica_tells_is_skipped_whole() -> None:
    good = messages.line(Sent("prefill", URL, (1, 2)))
    assert good is not None
    too_many = base64.b64encode(b"\0" * 8 * (MAX_PIECES + 1)).decode()
    bad = [
        "s\tprefill\tu\tnot base64!",
        "s\tprefill\tu\tAAAA",  # (3 bytes: no whole hash)
        f"s\tprefill\tu\t{too_many}",
        "s\tstorage\tu\tAAAAAAAAAAA=",  # (a pool that is not one)
        "p\tprefill\tu\t\tAAA",
        "x\tprefill\tu",
        "",
    ]
    replica, told = messages.read(messages.entry("r1", [*bad, good]))
    assert (replica, told) == ("r1", [Sent("prefill", URL, (1, 2))])
    assert messages.read("v0 r1\n" + good) == ("", [])  # (another version: none of it)


def test_a_prefix_heard_is_remembered_and_not_told_on() -> None:
    told: list[Any] = []
    mine, theirs = SentPrefixes(1000), SentPrefixes(1000)
    mine.on_sent(lambda chain, url: told.append((chain, url)))
    theirs.on_sent(lambda chain, url: told.append(("echoed", url)))
    chain = pieces(b"d" * 4096)
    mine.sent(chain, URL)
    assert told == [(chain, URL)]
    assert theirs.remember(chain, URL)  # (what the replica reading the stream does)
    assert theirs.longest((*chain, 99), {URL}) == {URL: len(chain)}
    assert told == [(chain, URL)]  # nothing told again
    assert not SentPrefixes(0).remember(chain, URL)  # (a pool that remembers nothing)


def events(clock: Clock) -> KvEvents:
    config = ProxyConfig.create(prefill=[URL], decode=["http://d:1"])
    kv = KvEvents(clock, clock, (), config)
    kv.index("prefill").apply("http://other", [Stored((9,), None, tuple(range(16)), 16)])
    return kv


def test_a_prediction_of_new_blocks_is_told_and_one_of_held_blocks_is_not() -> None:
    clock = Clock()
    kv = events(clock)
    told: list[Any] = []
    kv.on_predicted(lambda *said: told.append(said))
    kv.predict("prefill", URL, PROMPT, "s")
    assert told == [("prefill", URL, PROMPT, "s")]
    kv.index("prefill").apply(URL, [Stored((1, 2, 3), None, PROMPT, 16)])
    kv.predict("prefill", URL, PROMPT)  # held: every replica's events say so already
    assert len(told) == 1


def test_a_prediction_heard_counts_for_what_is_left_of_its_life() -> None:
    clock = Clock()
    kv = events(clock)
    told: list[Any] = []
    kv.on_predicted(lambda *said: told.append(said))
    assert kv.foretold("prefill", URL, PROMPT, None, age=PREDICTED_LIFE - 2)
    index = kv.index("prefill")
    assert index.reach(PROMPT, {URL})[URL].expected == 48
    assert told == []  # not told on
    clock.advance(2)
    assert index.reach(PROMPT, {URL}) == {}
    assert not kv.foretold("prefill", URL, PROMPT, None, age=PREDICTED_LIFE)  # read too late
    assert index.reach(PROMPT, {URL}) == {}


def test_what_another_replica_told_is_applied_once_and_its_own_not_at_all() -> None:
    clock = Clock()
    replicas = Replicas("redis://127.0.0.1:1/0", clock, clock, ReplicaMetrics(CollectorRegistry()))
    pool = BackendPool("prefill", [URL], clock)
    pool.sent.resize(1000)
    kv = events(clock)
    outbox = Outbox(replicas, clock, replicas.metrics)
    routes = SharedRoutes(replicas, outbox, lambda: (pool,), kv, replicas.metrics)
    chain = pieces(b"d" * 1024)
    told: list[messages.Told] = [Sent("prefill", URL, chain), Predicted("prefill", URL, PROMPT)]
    lines = [x for x in map(messages.line, told) if x is not None]
    routes._heard("s", messages.entry(replicas.id, lines), 0.0)  # its own: applied as it chose
    assert pool.sent.longest(chain, {URL}) == {}
    assert kv.index("prefill").reach(PROMPT, {URL}) == {}
    routes._heard("s", messages.entry("another", lines), 0.0)
    assert pool.sent.longest(chain, {URL}) == {URL: len(chain)}
    assert kv.index("prefill").reach(PROMPT, {URL})[URL].expected == 48
    heard = replicas.metrics.heard
    assert [heard.labels(kind=k)._value.get() for k in ("sent", "predicted")] == [1, 1]
    clock.advance(0)
    assert replicas.metrics.told.labels(kind="sent")._value.get() == 0  # nothing told on
