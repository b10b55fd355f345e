"""Phase A's placement: the prefill slot alone, decided on a decode instance named without a
policy (no trace in any policy), and phase B's decode slot on that instance when it has room."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from twisted.internet.task import Clock

from nixl_twisted.admission import Pool, RunAhead
from nixl_twisted.backends.capacity import Caps
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.policies import REGISTRY, Parts, chosen
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.prefixes import SentPrefixes
from nixl_twisted.backends.routing import Routing
from nixl_twisted.config import Disaggregation
from nixl_twisted.exchange.decide import Mode
from nixl_twisted.exchange.placing import Placed, Prefilling, place_decode, place_prefill
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.protocol.completion import read_completion

TOKENS = tuple(range(100))


class Held:
    """The KV events' say: how many of the prompt's tokens each decode instance holds."""

    def __init__(self, cached: dict[str, int]) -> None:
        self.cached = cached

    def cached_tokens(
        self, instance: Instance, tokens: Sequence[int], salt: str | None = None
    ) -> int | None:
        return self.cached.get(instance.url)


class Backends:
    def __init__(self, prefill: BackendPool, decode: BackendPool) -> None:
        self.prefill, self.decode = prefill, decode


class Legs:
    """What ``place_prefill`` reads of the proxy's ``Legs``."""

    def __init__(self, policy: str, cached: dict[str, int]) -> None:
        clock = Clock()
        self.clock = clock
        urls = ["http://d1:1#max-in-flight=1", "http://d2:1#max-in-flight=1"]
        self.decode = BackendPool("decode", urls, clock)
        self.decode.use_caps(Caps())
        self.decode.sent = SentPrefixes(64)  # (cache-aware's memory, kv-aware's fallback's)
        self.decode.use_policies(chosen(policy, Parts(sent=self.decode.sent)))
        self.prefill = BackendPool("prefill", ["http://p1:1#max-in-flight=1"], clock)
        self.prefill.use_caps(Caps())
        self.backends = Backends(self.prefill, self.decode)
        self.metrics = ProxyMetrics()
        self.kv = Held(cached)


def completion() -> Any:
    body = b'{"model": "m", "prompt": "' + b"word " * 100 + b'"}'
    return read_completion(body, "/v1/completions", "r1", 16)


def traces(legs: Legs, routing: Routing) -> tuple[Any, ...]:
    """What a policy's choice leaves: the cursor, cache-aware's memory, kv-aware's
    predictions and matches, and the routing counters."""
    decisions = [s for m in legs.metrics.routing_decisions.collect() for s in m.samples]
    return (
        legs.decode._cursor,
        len(legs.decode.sent),
        dict(routing.matched),
        dict(routing.predicted),
        len(decisions),
    )


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_naming_a_decode_instance_for_the_cached_rule_leaves_no_trace(policy: str) -> None:
    legs = Legs(policy, {"http://d2:1": 99})
    rules = Disaggregation(0, 8, 0, 0, "none")
    routing = Routing(prompt=b"p", chain=(1, 2), prompt_bytes=500, tokens=TOKENS)
    before = traces(legs, routing)
    got = place_prefill(legs, rules, completion(), routing, RunAhead(legs.decode))  # type: ignore[arg-type]
    # Cached on d2 (named: it holds most of the prompt): decode alone, on d2, in one step.
    assert isinstance(got, Placed) and got.decision is not None
    assert got.decision.mode is Mode.DECODE_ONLY
    assert got.decode.instance.url == "http://d2:1"
    assert traces(legs, routing) == before


def test_two_legs_hold_the_prefill_slot_alone_and_the_decode_slot_comes_on_the_named() -> None:
    legs = Legs("round-robin", {"http://d2:1": 10})
    rules = Disaggregation(0, 8, 0, 0, "none")
    routing = Routing(tokens=TOKENS)
    ahead = RunAhead(legs.decode)
    got = place_prefill(legs, rules, completion(), routing, ahead)  # type: ignore[arg-type]
    assert isinstance(got, Prefilling) and got.decode is None
    assert got.named is not None and got.named.url == "http://d2:1"
    assert [i.in_flight for i in legs.decode.instances] == [0, 0]
    assert legs.prefill.instances[0].in_flight == 1 and ahead.ahead(None) == 1
    decode = place_decode(legs, routing, got.decision, got.named)  # type: ignore[arg-type]
    assert isinstance(decode, Placed) and decode.decode.instance.url == "http://d2:1"
    # Named full: the policy's choice among those with room; none with room: it waits.
    other = place_decode(legs, routing, got.decision, got.named)  # type: ignore[arg-type]
    assert isinstance(other, Placed) and other.decode.instance.url == "http://d1:1"
    assert place_decode(legs, routing, got.decision, got.named) == Pool.DECODE  # type: ignore[arg-type]
    forced = place_decode(legs, routing, got.decision, got.named, force=True)  # type: ignore[arg-type]
    assert isinstance(forced, Placed) and forced.decode.instance.in_flight == 2
    got.release()
    assert legs.prefill.instances[0].in_flight == 0 and ahead.ahead(None) == 0


def test_past_the_run_ahead_limit_a_two_leg_request_waits_for_decode() -> None:
    legs = Legs("round-robin", {})
    ahead = RunAhead(legs.decode)
    ahead.set = 1
    ahead.hold(None)
    got = place_prefill(legs, Disaggregation(0, 0, 0, 0, "none"), completion(), Routing(), ahead)  # type: ignore[arg-type]
    assert got == Pool.DECODE and legs.prefill.instances[0].in_flight == 0
