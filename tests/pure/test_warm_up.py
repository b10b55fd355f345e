"""``--warm-up``: an instance that joined lately takes the cache policies' misses, on a Clock."""

from __future__ import annotations

from twisted.internet.task import Clock

from nixl_twisted.backends import policies
from nixl_twisted.backends.health import Thresholds
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.prefixes import SentPrefixes, pieces
from nixl_twisted.backends.routing import Routing
from nixl_twisted.kv.blocks import Stored
from tests.pure.test_routing import TOKENS, Indexed

WARM_UP = 60.0


def cache_aware(count: int, clock: Clock, checked: bool = False) -> BackendPool:
    urls = [f"http://p{i}:1" for i in range(count)]
    pool = BackendPool("prefill", urls, clock, checked=checked)
    pool.sent = SentPrefixes(1000)
    pool.use_policies(policies.chosen("cache-aware", policies.Parts(sent=pool.sent)))
    pool.warm_up = WARM_UP
    return pool


def miss(n: int) -> Routing:
    """A new conversation's prompt: nothing of it was sent anywhere."""
    prompt = f"conversation {n}: ".encode() + b"x" * 600
    return Routing(prompt=prompt[:512], chain=pieces(prompt), prompt_bytes=len(prompt))


def busy(*instances: Instance, legs: int) -> None:
    for instance in instances:
        instance.in_flight = legs


def test_a_joining_instance_takes_the_misses_while_under_the_others_mean() -> None:
    clock = Clock()
    pool = cache_aware(2, clock)
    old = list(pool.instances)
    busy(*old, legs=3)
    assert [i.warm_until > pool.clock.seconds() for i in old] == [False, False]
    (new,) = pool.add("http://p9:1")  # (no health checks: in rotation at once)
    for n in range(3):
        assert pool.choose(routing=miss(n)) == (new, "warm_up")
        new.in_flight += 1
    # As busy as the others' mean: misses go by the policy's own rule again.
    decisions = {pool.choose(routing=miss(n))[1] for n in range(3, 20)}
    assert "warm_up" not in decisions
    # A prompt that follows what an old instance was sent stays there.
    new.in_flight = 0
    followed = miss(1000)
    chosen, _ = pool.choose(routing=followed)
    again = pool.choose(routing=followed)
    assert again == (chosen, "prefix")
    # And once the warm-up is over, no more.
    clock.advance(WARM_UP)
    assert "warm_up" not in {pool.choose(routing=miss(n))[1] for n in range(30, 40)}


def test_an_instance_up_again_after_down_warms_up_but_not_one_the_proxy_started_with() -> None:
    clock = Clock()
    pool = cache_aware(3, clock, checked=True)
    pool.thresholds = Thresholds(unhealthy=1, healthy=1)
    third = pool.instances[2]
    for instance in pool.instances:  # the first round of checks: all start cold together
        pool.record_success(instance)
    busy(*pool.instances, legs=2)
    assert {pool.choose(routing=miss(n))[1] for n in range(10)} & {"warm_up"} == set()
    clock.advance(10)
    (new,) = pool.add("http://p9:1")  # joins (in rotation at its first check) ...
    pool.record_success(new)
    assert pool.choose(routing=miss(50)) == (new, "warm_up")  # (the others are not warming)
    pool.remove(new.url)
    pool.record_failure(third, "refused")
    third.in_flight = 0
    clock.advance(5)
    pool.record_success(third)  # back
    assert pool.choose(routing=miss(100)) == (third, "warm_up")


def test_off_with_zero_seconds() -> None:
    clock = Clock()
    pool = cache_aware(2, clock)
    pool.warm_up = 0.0
    busy(*pool.instances, legs=3)
    pool.add("http://p9:1")
    assert "warm_up" not in {pool.choose(routing=miss(n))[1] for n in range(10)}


def test_kv_aware_sends_a_miss_to_the_warming_instance_not_only_the_least_loaded() -> None:
    urls = {"http://p0:1", "http://p1:1", "http://p9:1"}
    held = Indexed(urls)
    pool = BackendPool("prefill", ["http://p0:1", "http://p1:1"], held.clock)
    pool.use_policies(policies.chosen("kv-aware", policies.Parts(held=held)))
    pool.warm_up = WARM_UP
    idle, loaded = pool.instances
    loaded.in_flight = 4
    (new,) = pool.add("http://p9:1")
    new.in_flight = 1  # more than the idle one, under the others' mean (2)
    unheld = Routing(prompt=b"k", tokens=tuple(range(64)))
    assert pool.choose(routing=unheld) == (new, "warm_up")
    # A prompt an old instance holds is still a hit there.
    held.index.apply(idle.url, [Stored((1, 2, 3, 4), None, TOKENS, 16)])
    assert pool.choose(routing=Routing(prompt=b"k", tokens=TOKENS)) == (idle, "kv_match")
    held.clock.advance(WARM_UP)
    assert pool.choose(routing=Routing(prompt=b"k", tokens=tuple(range(64))))[1] == "no_match"
