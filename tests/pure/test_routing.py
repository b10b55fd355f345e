"""Routing policies as functions: candidates in, an instance and a decision out."""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from nixl_twisted.backends import policies, prompt_keys, routing
from nixl_twisted.backends.holdings import Reach
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.prefixes import PIECE_BYTES, SentPrefixes, pieces
from nixl_twisted.backends.routing import Routing, load_score, rendezvous
from nixl_twisted.config.settings import POLICIES
from nixl_twisted.kv.blocks import Stored
from nixl_twisted.kv.index import KvIndex
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.prompts import render


def completion(body: dict[str, Any]) -> Completion:
    """A completion of ``body``, as the door would read it."""
    return Completion(routes.COMPLETIONS, body, "r")


def prompt_key(body: dict[str, Any], key_bytes: int) -> bytes | None:
    """The conversation key of ``body``'s prompt (``Rendered.key``)."""
    return render(body).key(key_bytes)


def routing_for(
    policies: set[str], key_bytes: int, session: bytes | None, body: dict[str, Any]
) -> Routing:
    return prompt_keys.routing_for(needs(policies), key_bytes, session, completion(body))


def needs(names: Collection[str]) -> policies.Needs:
    return policies.needs(names)


def session_key(header: bytes | None, body: dict[str, Any]) -> str | None:
    return prompt_keys.session_key(header, completion(body))


def pool_of(count: int, name: str = "prefill") -> BackendPool:
    return BackendPool(name, [f"http://p{i}:1" for i in range(count)], Clock())


def use(pool: BackendPool, name: str, balance: float = 1.5) -> BackendPool:
    pool.use_policies(policies.chosen(name, policies.Parts(routing.Balance(balance))))
    return pool


def test_the_settings_name_every_policy_and_no_other() -> None:
    assert tuple(policies.REGISTRY) == POLICIES


def test_least_loaded_takes_the_fewest_legs_ties_in_rotation() -> None:
    pool = use(pool_of(3), "least-loaded")
    a, b, c = pool.instances
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 0
    chosen = [pool.choose()[0] for _ in range(4)]
    assert chosen == [b, c, b, c]
    assert pool.choose()[1] == "fewest_in_flight"


def test_load_prefers_what_vllm_reports_plus_this_proxys_legs_since() -> None:
    pool = use(pool_of(2), "load")
    busy, idle = pool.instances
    busy.load = {"running": 6.0, "waiting": 2.0, "kv_cache_usage": 0.5, "ours": 1.0}
    idle.load = {"running": 1.0, "waiting": 0.0, "kv_cache_usage": 0.1, "ours": 1.0}
    assert load_score(busy) > load_score(idle)
    assert {pool.choose()[0] for _ in range(20)} == {idle}
    idle.in_flight = 20  # a burst from this proxy since the scrape shows at once
    assert pool.choose()[0] is busy


def test_load_without_metrics_falls_back_to_in_flight() -> None:
    pool = use(pool_of(2), "load")
    a, b = pool.instances
    a.in_flight = 3
    instance, decision = pool.choose()
    assert (instance, decision) == (b, "in_flight_only")


@given(st.binary(min_size=1, max_size=64))
def test_rendezvous_moves_only_the_keys_of_a_removed_instance(key: bytes) -> None:
    instances = [Instance(f"http://p{i}:1", "prefill") for i in range(4)]
    first = rendezvous(key, instances)[0]
    removed = instances[2]
    rest = [i for i in instances if i is not removed]
    again = rendezvous(key, rest)[0]
    assert again is first or first is removed


@given(st.binary(min_size=1, max_size=64))
def test_rendezvous_gives_a_joining_instance_only_the_keys_it_now_ranks_first(key: bytes) -> None:
    instances = [Instance(f"http://p{i}:1", "prefill") for i in range(4)]
    first = rendezvous(key, instances)[0]
    joined = Instance("http://10.0.0.7:1", "prefill")  # (what discovery adds)
    again = rendezvous(key, [*instances, joined])[0]
    assert again is first or again is joined


def test_cache_aware_keeps_a_conversation_on_one_instance_across_pools_and_processes() -> None:
    opening = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "tell me of NIXL"},
    ]
    conversation = {"model": "m", "messages": opening}
    later = dict(
        conversation,
        messages=[
            *conversation["messages"],
            {"role": "assistant", "content": "it moves KV"},
            {"role": "user", "content": "and then?"},
        ],
    )
    key, later_key = prompt_key(conversation, 512), prompt_key(later, 512)
    assert key == later_key  # every turn shares it
    one, other = use(pool_of(4), "cache-aware"), use(pool_of(4), "cache-aware")
    for pool in (one, other):
        pool.instances[1].in_flight = 1  # different load, same answer while balanced
    assert (
        one.choose(routing=Routing(prompt=key))[0].url
        == other.choose(routing=Routing(prompt=later_key))[0].url
    )


def test_the_balance_guard_moves_a_hot_key_to_its_next_instance() -> None:
    pool = use(pool_of(2), "cache-aware", balance=1.5)
    key = b"user\nthe same first question\n"
    home, decision = pool.choose(routing=Routing(prompt=key))
    assert decision == "affinity"
    home.in_flight = 3  # three legs more than the other: not measurably busier
    assert pool.choose(routing=Routing(prompt=key)) == (home, "affinity")
    home.in_flight = 4  # --cache-aware-margin (4) legs more, and 1.5 times as many
    moved, decision = pool.choose(routing=Routing(prompt=key))
    assert (moved is not home, decision) == (True, "balanced")


def test_conversations_sharing_a_system_prompt_still_spread() -> None:
    pool = use(pool_of(4), "cache-aware")
    system = {"role": "system", "content": "You are a helpful assistant. " * 40}
    homes = collections.Counter(
        pool.choose(
            routing=Routing(
                prompt=prompt_key(
                    {"messages": [system, {"role": "user", "content": f"question {n}"}]}, 512
                )
            )
        )[0].url
        for n in range(200)
    )
    assert len(homes) == 4 and min(homes.values()) > 20


def test_a_completion_is_keyed_by_its_leading_bytes() -> None:
    long = "x" * 600
    assert prompt_key({"prompt": long}, 512) == prompt_key({"prompt": long + " more"}, 512)
    assert prompt_key({"prompt": [1, 2, 3]}, 512) == b"1,2,3"
    assert prompt_key({"prompt": ""}, 512) is None


def test_keys_take_any_json_string_and_ignore_what_is_not_text() -> None:
    # A lone surrogate is valid as a JSON escape, not as UTF-8.
    assert prompt_key({"prompt": "a\ud800"}, 512) == b"a\xed\xa0\x80"
    chat = {"messages": [{"role": "user", "content": [{"text": "\udfff"}, {"text": [[1]]}]}]}
    assert prompt_key(chat, 512) == b"user\n\xed\xbf\xbf\n"
    odd = {"messages": [{"role": {"nested": [1]}, "content": 7}, {"role": "user"}]}
    assert prompt_key(odd, 512) == b"\n\nuser\n\n"
    pool = use(pool_of(3, "decode"), "session")
    assert pool.choose(routing=Routing(session="\ud800"))[1] == "session"


def test_session_follows_the_session_key_else_rotates() -> None:
    pool = use(pool_of(3, "decode"), "session")
    chosen = {pool.choose(routing=Routing(session="alice"))[0] for _ in range(10)}
    assert len(chosen) == 1
    assert pool.choose()[1] == "no_session"
    assert session_key(b"s-1", {"user": "bob"}) == "s-1"
    assert session_key(None, {"user": "bob"}) == "bob"


def test_every_policy_skips_down_and_draining_instances() -> None:
    for name in POLICIES:
        pool = use(pool_of(3), name)
        a, b, c = pool.instances
        for _ in range(3):
            pool.record_failure(a, "refused")
        b.in_flight = 1
        pool.drain(b.url)
        assert {pool.choose(routing=Routing(prompt=b"k", session="s"))[0] for _ in range(6)} == {
            c
        }, name


def test_a_request_is_routed_on_what_the_policies_in_use_look_at() -> None:
    from nixl_twisted.backends.routing import NO_ROUTING

    body = {"prompt": "p" * 100, "user": "u1"}
    assert routing_for({"round-robin", "load"}, 8, b"s1", body) is NO_ROUTING
    assert routing_for({"cache-aware"}, 8, b"s1", body) == Routing(
        prompt=b"p" * 8, prompt_bytes=100
    )
    assert routing_for({"session"}, 8, b"s1", body) == Routing(session="s1")
    assert routing_for({"session", "round-robin"}, 8, None, body) == Routing(session="u1")
    both = routing_for({"cache-aware", "session"}, 4, None, body)
    assert both == Routing(prompt=b"pppp", session="u1", prompt_bytes=100)
    long = routing_for({"cache-aware"}, 8, None, {"prompt": "q" * 600})
    assert long.chain == pieces(b"q" * 600) and len(long.chain) == 2


def remembering(count: int, entries: int = 1000, min_match: float = 0.5) -> BackendPool:
    pool = pool_of(count)
    pool.sent = SentPrefixes(entries)
    pool.use_policies(
        policies.chosen("cache-aware", policies.Parts(sent=pool.sent, min_match=min_match))
    )
    return pool


def asking(document: str, question: str) -> Routing:
    body = {"messages": [{"role": "user", "content": f"{document}\n\n{question}"}]}
    return routing_for({"cache-aware"}, 512, None, body)


DOCUMENT = "The KV cache of a long document, block after block. " * 60


def test_a_new_conversation_over_a_known_document_goes_where_the_document_went() -> None:
    pool = remembering(4)
    questions = [f"Question {n}: why?" for n in range(40)]
    # Without the memory, the opening decides: these would spread over all four.
    assert (
        len({rendezvous(asking(DOCUMENT, q).prompt or b"", pool.instances)[0] for q in questions})
        > 1
    )
    first, decision = pool.choose(routing=asking(DOCUMENT, questions[0]))
    assert decision == "affinity"
    # However many conversations it drew: an idle fleet never computes the document again.
    for question in questions[1:]:
        assert pool.choose(routing=asking(DOCUMENT, question)) == (first, "prefix")


def test_a_prefix_shorter_than_the_min_match_share_draws_a_prompt_only_where_load_is_level() -> (
    None
):
    pool = remembering(4, min_match=0.5)
    home, _ = pool.choose(routing=asking(DOCUMENT, "first"))
    # The same document under a longer question of its own: under half is shared. Where
    # nothing is busier, the hit decides.
    assert pool.choose(routing=asking(DOCUMENT, "another " * 500)) == (home, "prefix")
    home.in_flight = 2  # two legs more than the others: the load decides, as for a new one
    _, decision = pool.choose(routing=asking(DOCUMENT, "yet another " * 500))
    assert decision in ("affinity", "balanced")
    followed = remembering(4, min_match=0.1)
    home, _ = followed.choose(routing=asking(DOCUMENT, "first"))
    home.in_flight = 2
    assert followed.choose(routing=asking(DOCUMENT, "another " * 500)) == (home, "prefix")


def test_the_balance_guard_and_membership_win_over_the_memory() -> None:
    pool = remembering(2)
    home, _ = pool.choose(routing=asking(DOCUMENT, "first"))
    home.in_flight = 12  # far busier than the other (4 legs more, 1.5 times as many)
    other, decision = pool.choose(routing=asking(DOCUMENT, "second"))
    assert other is not home and decision in ("affinity", "balanced")
    home.in_flight = 0
    pool.remove(home.url)
    assert pool.choose(routing=asking(DOCUMENT, "third"))[0] is other


def test_prompts_sharing_a_document_stay_together_until_their_instance_is_measurably_busier() -> (
    None
):
    pool = remembering(4)
    home, _ = pool.choose(routing=asking(DOCUMENT, "first"))
    home.in_flight = 3
    assert pool.choose(routing=asking(DOCUMENT, "second")) == (home, "prefix")
    home.in_flight = 4  # four legs (--cache-aware-margin) more than the least busy: moved
    moved, decision = pool.choose(routing=asking(DOCUMENT, "fourth"))
    assert (moved is not home, decision) == (True, "balanced")
    other = Routing(prompt=rendezvous_key_for(home, pool), chain=())
    assert pool.choose(routing=other)[1] == "balanced"
    home.in_flight = 1
    assert pool.choose(routing=other) == (home, "affinity")


def rendezvous_key_for(instance: Instance, pool: BackendPool) -> bytes:
    """A conversation key whose first instance by rendezvous is ``instance``."""
    return next(
        key
        for key in (f"user\nopening {n}\n".encode() for n in range(1000))
        if rendezvous(key, pool.instances)[0] is instance
    )


def test_the_memory_follows_the_last_instance_sent_and_forgets_the_oldest() -> None:
    chain = pieces(DOCUMENT.encode())
    sent = SentPrefixes(entries=len(chain))
    both = {"http://a", "http://b"}
    sent.sent(chain, "http://a")
    assert sent.longest(chain, both) == {"http://a": len(chain)}
    sent.sent(chain[:3], "http://b")  # a shorter prompt, sent elsewhere since: both hold it
    assert sent.longest(chain, both) == {"http://a": len(chain), "http://b": 3}
    assert sent.longest(chain, {"http://b"}) == {"http://b": 3}  # a is no candidate
    for n in range(5):  # at most four holders per prefix, the latest kept
        sent.sent(chain[:1], f"http://c{n}")
    assert sent.longest(chain[:1], both | {f"http://c{n}" for n in range(5)}) == {
        f"http://c{n}": 1 for n in range(1, 5)
    }
    other = pieces(b"another prompt entirely " * 40)
    sent.sent(other, "http://b")  # the least recently used (the 4th to 6th pieces) give way
    assert len(sent) == len(chain)
    assert sent.longest(chain, both) == {"http://a": 3, "http://b": 3}
    sent.resize(2)
    assert len(sent) == 2
    sent.resize(0)
    sent.sent(chain, "http://a")
    assert len(sent) == 0


def test_a_prefix_hash_stands_for_everything_before_it() -> None:
    text = DOCUMENT.encode()
    chain = pieces(text)
    assert len(chain) == len(text) // PIECE_BYTES
    assert pieces(text + b"a different tail")[: len(chain)] == chain
    changed = b"X" + text[1:]
    assert not set(pieces(changed)) & set(chain)  # one byte early changes every later hash
    assert pieces(b"short") == ()


class Indexed:
    """``Holdings`` over a real ``KvIndex``: what kv-aware asks of the KV events."""

    def __init__(self, listening: set[str], stale: Collection[str] = ()) -> None:
        self.clock = Clock()
        self.index = KvIndex(1000, self.clock)
        self._listening = listening
        self._stale = stale

    def reach(
        self, role: str, tokens: Sequence[int], urls: Collection[str], salt: str | None = None
    ) -> dict[str, Reach]:
        return self.index.reach(tokens, urls, salt=salt)

    def predict(
        self, role: str, url: str, tokens: Sequence[int], salt: str | None = None
    ) -> Callable[[], object]:
        prediction = self.index.predict(url, tokens, salt=salt)
        return lambda: self.index.withdraw(prediction)

    def listening(self, role: str, url: str) -> bool:
        return url in self._listening

    def stale(self, role: str, url: str) -> bool:
        return url in self._stale

    def blocks(self, role: str, url: str) -> int:
        return self.index.blocks(url) + self.index.predicted(url)


TOKENS = tuple(range(2000, 2064))


def kv_pool(count: int, held: Indexed) -> BackendPool:
    pool = pool_of(count)
    pool.use_policies(policies.chosen("kv-aware", policies.Parts(held=held)))
    return pool


def test_kv_aware_takes_the_instance_holding_the_longest_prefix() -> None:
    held = Indexed({f"http://p{i}:1" for i in range(3)})
    pool = kv_pool(3, held)
    a, b, c = pool.instances
    held.index.apply(a.url, [Stored((1, 2), None, TOKENS[:32], 16)])  # half the prompt
    held.index.apply(b.url, [Stored((1, 2, 3), None, TOKENS[:48], 16)])
    held.index.apply(c.url, [Stored((1,), None, TOKENS[:16], 16)])  # under --cache-aware-min-match
    asked = Routing(prompt=b"k", tokens=TOKENS)
    assert pool.choose(routing=asked) == (b, "kv_match")
    assert asked.matched == {"prefill": 48}
    b.in_flight = 6  # measurably busier (4 legs more than the least busy): the next longest
    assert pool.choose(routing=Routing(prompt=b"k", tokens=TOKENS)) == (a, "balanced")
    b.in_flight = 0
    other = Routing(prompt=b"k", tokens=tuple(range(64)))
    a.in_flight = b.in_flight = 1
    assert pool.choose(routing=other) == (c, "no_match")  # nobody holds it: the least loaded
    assert other.matched == {"prefill": 0}


def test_kv_aware_falls_back_to_cache_aware_and_says_why() -> None:
    urls = {f"http://p{i}:1" for i in range(2)}
    pool = kv_pool(2, Indexed(urls))
    assert pool.choose(routing=Routing(prompt=b"k"))[1] == "fallback_no_tokens"
    untokenized = Routing(prompt=b"k", untokenized="render")
    assert pool.choose(routing=untokenized)[1] == "fallback_render"
    pool = kv_pool(2, Indexed({"http://p0:1"}))
    assert pool.choose(routing=Routing(prompt=b"k", tokens=TOKENS))[1] == "fallback_no_events"
    pool = kv_pool(2, Indexed(urls, stale={"http://p1:1"}))
    instance, decision = pool.choose(routing=Routing(prompt=b"k", tokens=TOKENS))
    assert decision == "fallback_stale"
    # The fallback is cache-aware: the key's own instance, by rendezvous.
    assert instance.url == rendezvous(b"k", pool.instances)[0].url
    # A token-id prompt needs no render.
    assert routing_for({"kv-aware"}, 8, None, {"prompt": list(TOKENS)}).tokens == TOKENS


# -- cache_salt: a namespace of vLLM's prefix cache, so of every routing key --------


def salted(body: dict[str, Any], salt: str | None) -> Completion:
    return Completion(routes.CHAT_COMPLETIONS, body, "r", salt=salt)


def test_every_routing_key_is_its_salts_own() -> None:
    body = {"messages": [{"role": "user", "content": DOCUMENT}], "user": "u1"}
    every = needs({"cache-aware", "kv-aware", "session"})
    keys = {
        salt: prompt_keys.routing_for(every, 512, None, salted(body, salt))
        for salt in (None, "tenant-a", "tenant-b")
    }
    assert len({r.prompt for r in keys.values()}) == 3
    assert len({r.session for r in keys.values()}) == 3
    chains = [set(r.chain) for r in keys.values()]
    assert all(chains) and not chains[0] & chains[1] and not chains[1] & chains[2]
    assert keys[None].prompt == prompt_key(body, 512) and keys[None].session == "u1"
    assert keys["tenant-a"].salt == "tenant-a"
    only_session = prompt_keys.routing_for(needs({"session"}), 512, b"s", salted(body, "tenant-a"))
    assert only_session.session == "tenant-a\0s"


def test_cache_aware_never_follows_a_prefix_another_salt_sent() -> None:
    pool = remembering(8)

    def ask(question: str, salt: str | None) -> Routing:
        body = {"messages": [{"role": "user", "content": f"{DOCUMENT}\n\n{question}"}]}
        return prompt_keys.routing_for(needs({"cache-aware"}), 512, None, salted(body, salt))

    first, _ = pool.choose(routing=ask("Why?", "tenant-a"))
    assert pool.choose(routing=ask("How?", "tenant-a")) == (first, "prefix")
    for n in range(8):
        assert pool.choose(routing=ask(f"Question {n}?", f"tenant-{n}"))[1] != "prefix"


def test_kv_aware_never_predicts_or_matches_across_salts() -> None:
    held = Indexed({f"http://p{i}:1" for i in range(2)})
    pool = kv_pool(2, held)
    a, _ = pool.instances
    held.index.apply(a.url, [Stored((1, 2, 3), None, TOKENS[:48], 16, salt="tenant-a")])
    unsalted = Routing(prompt=b"k", tokens=TOKENS)
    assert pool.choose(routing=unsalted)[1] == "no_match"
    assert pool.choose(routing=Routing(prompt=b"k", tokens=TOKENS, salt="tenant-a")) == (
        a,
        "kv_match",
    )
    fresh = Indexed({f"http://p{i}:1" for i in range(2)})
    pool = kv_pool(2, fresh)
    first, _ = pool.choose(routing=Routing(prompt=b"k", tokens=TOKENS, salt="tenant-a"))
    pool.lease(first)  # its leg in flight: predicted, not yet reported
    again = Routing(prompt=b"k", tokens=TOKENS, salt="tenant-a")
    assert pool.choose(routing=again) == (first, "kv_predicted")
    other = Routing(prompt=b"k", tokens=TOKENS, salt="tenant-b")
    assert pool.choose(routing=other)[1] == "no_match" and other.matched == {"prefill": 0}
