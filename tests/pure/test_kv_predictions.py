"""kv-aware's predictions: blocks recorded when routing, settled by vLLM's events, under a Clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.task import Clock

from nixl_twisted.backends import policies
from nixl_twisted.backends.holdings import Reach
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.routing import Routing
from nixl_twisted.exchange.sending import ByPolicy, Retry, send_leg
from nixl_twisted.kv.blocks import Cleared, Removed, Stored
from nixl_twisted.kv.index import KvIndex
from nixl_twisted.kv.predictions import PREDICTED_LIFE
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from tests.pure.test_legs import run
from tests.pure.test_routing import Indexed

A, B = "http://a:8100", "http://b:8100"
PROMPT = tuple(range(1000, 1048))  # 3 whole blocks of 16


def held(tokens: Sequence[int], hashes: Sequence[int], parent: int | None = None) -> Stored:
    return Stored(tuple(hashes), parent, tuple(tokens), 16)


def indexed() -> tuple[KvIndex, Clock]:
    clock = Clock()
    index = KvIndex(1000, clock)
    index.apply(A, [held(range(5000, 5016), [99])])  # the pool's block size is known: 16
    return index, clock


def test_a_prediction_counts_at_once_and_a_blockstored_confirms_it() -> None:
    index, clock = indexed()
    index.predict(B, PROMPT)
    assert index.reach(PROMPT, {A, B}) == {B: Reach(confirmed=0, expected=48)}
    assert index.matched(PROMPT, {A, B}) == {}  # the decide rules count confirmed blocks only
    index.apply(B, [held(PROMPT[:32], [1, 2])])  # vLLM reports two of the three blocks
    assert index.reach(PROMPT, {B}) == {B: Reach(confirmed=32, expected=48)}
    assert (index.predicted(B), index.outcomes(B)) == (1, {"confirmed": 2})
    index.apply(B, [held(PROMPT[32:], [3], parent=2)])
    clock.advance(PREDICTED_LIFE + 1)  # confirmed blocks have no life to run out
    assert index.reach(PROMPT, {B}) == {B: Reach(confirmed=48, expected=48)}
    assert (index.predicted(B), index.outcomes(B)) == (0, {"confirmed": 3})


def test_a_prediction_nobody_confirms_expires_after_its_life() -> None:
    index, clock = indexed()
    index.predict(B, PROMPT)
    clock.advance(PREDICTED_LIFE - 0.5)
    assert index.reach(PROMPT, {B})[B].expected == 48
    clock.advance(0.5)
    assert index.reach(PROMPT, {B}) == {}
    assert (index.predicted(B), index.outcomes(B)) == (0, {"expired": 3})


def test_choosing_the_same_blocks_again_gives_them_a_new_life() -> None:
    index, clock = indexed()
    index.predict(B, PROMPT)
    clock.advance(PREDICTED_LIFE - 1)
    index.predict(B, PROMPT[:16])
    clock.advance(2)
    assert index.reach(PROMPT, {B}) == {B: Reach(0, 16)}
    assert index.outcomes(B) == {"expired": 2}


def test_what_an_instance_holds_is_not_predicted_again() -> None:
    index, _ = indexed()
    index.apply(B, [held(PROMPT[:16], [1])])
    assert len(index.predict(B, PROMPT).keys) == 2  # the two blocks it does not hold yet
    assert index.reach(PROMPT, {B}) == {B: Reach(16, 48)}


def test_a_removed_block_is_gone_whatever_was_predicted() -> None:
    index, _ = indexed()
    index.predict(B, PROMPT)
    index.apply(B, [held(PROMPT, [1, 2, 3])])
    index.apply(B, [Removed((2,))])
    assert index.reach(PROMPT, {B}) == {B: Reach(16, 16)}  # the chain breaks at the second
    index.predict(B, PROMPT)  # sent again: the second and third predicted anew
    index.apply(B, [Removed((1,))])  # and then its first block evicted
    assert index.reach(PROMPT, {B}) == {}
    assert index.outcomes(B) == {"confirmed": 3}


def test_a_cleared_cache_drops_the_predictions_too() -> None:
    index, _ = indexed()
    index.predict(B, PROMPT)
    index.apply(B, [Cleared()])
    assert index.reach(PROMPT, {B}) == {}
    assert index.outcomes(B) == {"cleared": 3}
    index.predict(B, PROMPT)
    index.clear(B)  # a gap nobody can replay, a restarted vLLM: the same
    assert index.outcomes(B) == {"cleared": 6}
    index.left(B)  # it left its pool: nothing of it is kept, its counts neither
    assert index.outcomes(B) == {} and index.predicted(B) == 0


def test_a_withdrawn_prediction_drops_only_what_no_later_choice_predicted() -> None:
    index, clock = indexed()
    first = index.predict(B, PROMPT)
    clock.advance(1)
    index.predict(B, PROMPT[:16])  # another request, sharing the first block, sent since
    index.withdraw(first)
    assert index.reach(PROMPT, {B}) == {B: Reach(0, 16)}
    assert index.outcomes(B) == {"failed": 2}


def test_before_any_block_size_is_known_predictions_still_match() -> None:
    clock = Clock()
    index = KvIndex(1000, clock)  # a fleet just started: no instance has stored anything
    index.predict(B, PROMPT)
    assert index.reach(PROMPT, {A, B}) == {B: Reach(0, 48)}


def test_predictions_are_bounded_per_instance_as_blocks_are() -> None:
    clock = Clock()
    index = KvIndex(2, clock)
    index.predict(B, PROMPT)
    assert index.predicted(B) == 2  # the oldest went first
    assert index.reach(PROMPT, {B}) == {}


def test_an_index_without_a_clock_predicts_nothing() -> None:
    index = KvIndex(1000)
    index.withdraw(index.predict(B, PROMPT))
    assert index.reach(PROMPT, {B}) == {} and index.outcomes(B) == {}


def kv_pool(count: int) -> tuple[BackendPool, KvIndex, Clock]:
    """A kv-aware pool whose instances all publish, over a real index with a ``Clock``."""
    pool = BackendPool("prefill", [f"http://p{i}:1" for i in range(count)], Clock())
    held = Indexed({i.url for i in pool.instances})
    pool.use_policies(policies.chosen("kv-aware", policies.Parts(held=held)))
    return pool, held.index, held.clock


def asked(tokens: Sequence[int] = PROMPT) -> Routing:
    return Routing(prompt=b"k", tokens=tuple(tokens))


def test_two_prompts_sharing_a_new_prefix_go_to_one_instance_before_vllm_reports() -> None:
    pool, _, _ = kv_pool(4)
    first, decision = pool.choose(routing=asked())
    assert decision == "no_match"
    pool.lease(first)  # its leg in flight: any instance may take a second leg
    routed = asked([*PROMPT[:32], 7, 7, 7])  # the same first two blocks, its own tail
    second, decision = pool.choose(routing=routed)
    assert (second, decision) == (first, "kv_predicted")
    assert routed.matched == {"prefill": 32}


def test_a_prediction_never_outweighs_a_confirmed_hit_elsewhere() -> None:
    pool, index, _ = kv_pool(2)
    a, b = pool.instances
    index.apply(a.url, [held(PROMPT[:32], [1, 2])])  # a holds two blocks, confirmed
    index.predict(b.url, PROMPT)  # b was just sent all three
    assert pool.choose(routing=asked()) == (a, "kv_match")
    pool, index, _ = kv_pool(2)
    a, b = pool.instances
    index.apply(a.url, [held(PROMPT[:32], [1, 2])])
    index.apply(b.url, [held(PROMPT[:32], [8, 9])])  # both hold two blocks: a tie
    index.predict(b.url, PROMPT)  # which b's predicted third block breaks
    assert pool.choose(routing=asked()) == (b, "kv_predicted")


def test_a_shared_system_prompt_alone_draws_a_new_conversation_only_where_load_is_level() -> None:
    pool, index, _ = kv_pool(2)
    a, b = pool.instances
    index.apply(a.url, [held(PROMPT[:16], [1])])  # a third of the prompt: under min-match
    assert pool.choose(routing=asked()) == (a, "kv_match")  # an idle fleet: the hit decides
    a.in_flight = 1  # one leg more: level still
    assert pool.choose(routing=asked([*PROMPT[:16], *range(32)])) == (a, "kv_match")
    a.in_flight = 2  # two legs more: the load decides
    assert pool.choose(routing=asked([*PROMPT[:16], *range(100, 132)])) == (b, "no_match")


def test_a_failed_leg_withdraws_its_prediction_and_the_retry_predicts_its_own() -> None:
    pool, index, _ = kv_pool(2)
    tried: list[str] = []

    async def attempt(instance: Any, leg: Any) -> str:
        tried.append(instance.url)
        if len(tried) == 1:
            error = ProxyError(ErrorCode.PREFILL_UNREACHABLE, "unreachable")
            raise Retry(error, "unreachable", "connection refused")
        return "served"

    metrics = ProxyMetrics()
    lease, _ = run(send_leg(pool, metrics, attempt, ByPolicy(pool, metrics, asked(), retries=1)))
    failed, served_by = tried
    assert index.reach(PROMPT, [failed, served_by]) == {served_by: Reach(0, 48)}
    assert index.outcomes(failed) == {"failed": 3}
    lease.release()


def test_what_was_predicted_before_the_block_size_was_known_is_keyed_again_by_it() -> None:
    clock = Clock()
    index = KvIndex(1000, clock)
    prompt = tuple(range(2000, 2256))  # 2 blocks of 128
    index.predict(B, prompt)
    clock.advance(2)
    index.apply(A, [Stored((1,), None, tuple(range(9000, 9128)), 128)])  # the size: 128
    assert index.reach(prompt, {A, B}) == {B: Reach(0, 256)}
    assert index.predicted(B) == 2 and index.outcomes(B) == {}
    clock.advance(PREDICTED_LIFE - 2)  # the life they had, not a new one
    assert index.reach(prompt, {B}) == {}


def test_a_new_prefix_goes_to_the_least_loaded_then_the_least_cached_instance() -> None:
    pool, index, _ = kv_pool(3)
    a, b, c = pool.instances
    index.apply(a.url, [held(range(5000, 5016), [1])])
    index.predict(b.url, range(6000, 6032))  # two blocks on their way to b
    assert pool.choose(routing=asked()) == (c, "no_match")
    c.in_flight = 1
    assert pool.choose(routing=asked(range(7000, 7048))) == (a, "no_match")


def test_a_shared_prefix_draws_every_conversation_until_its_instance_is_measurably_busier() -> None:
    pool, index, _ = kv_pool(4)
    preamble = tuple(range(100, 164))  # four blocks every conversation opens with
    home = pool.instances[0]
    index.apply(home.url, [held(preamble, [1, 2, 3, 4])])

    def opening(n: int) -> Routing:
        return Routing(prompt=f"conversation {n}".encode(), tokens=(*preamble, *[n] * 8))

    # However many it drew, it is never computed again for a count's sake.
    assert [pool.choose(routing=opening(n)) for n in range(8)] == [(home, "kv_match")] * 8
    home.in_flight = 3
    assert pool.choose(routing=opening(8)) == (home, "kv_match")
    home.in_flight = 4  # --cache-aware-margin legs more than the least busy: moved
    copy, decision = pool.choose(routing=opening(9))
    assert (copy is not home, decision) == (True, "balanced")
