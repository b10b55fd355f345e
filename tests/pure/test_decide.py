"""The decide rules, one by one, on pools in memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from twisted.internet.task import Clock

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.config import ProxyConfig
from nixl_twisted.exchange.decide import Mode, Reason, blind_rules, decide, describe
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.completion import Completion

RULES = ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"]).disaggregation
#: 100 estimated tokens.
BODY = {"prompt": "abcd" * 100}


@dataclass
class Known:
    """What the decode instance is known to hold of every prompt."""

    tokens: int | None
    #: The ``cache_salt`` it holds them under.
    salt: str | None = None

    def cached_tokens(
        self, instance: Instance, tokens: Sequence[int], salt: str | None = None
    ) -> int | None:
        return self.tokens if salt == self.salt else 0


def decided(
    body: dict[str, Any] = BODY,
    holdings: Known | None = None,
    token_ids: Sequence[int] | None = None,
    **rules: Any,
) -> tuple[str, str]:
    prefill = _prefill_pool()
    decode = BackendPool("decode", ["http://d:1"], Clock()).instances[0]
    salt = body.get("cache_salt")
    decision = decide(
        replace(RULES, **rules),
        Completion(routes.COMPLETIONS, body, "r", salt=salt),
        decode,
        prefill,
        holdings,
        token_ids,
    )
    return decision.mode.value, decision.reason.value


def _prefill_pool(*in_flight: int) -> BackendPool:
    pool = BackendPool("prefill", [f"http://p{i}:1" for i in range(2)], Clock())
    for instance, legs in zip(pool.instances, in_flight, strict=False):
        instance.in_flight = legs
    return pool


def test_with_no_rule_every_request_takes_two_legs() -> None:
    assert RULES.always
    assert decided() == ("pd", "always")
    assert decided({"prompt": "a"}) == ("pd", "always")


def test_a_prompt_under_the_threshold_skips_prefill() -> None:
    assert decided(short_prompt=101) == ("decode_only", "short_prompt")
    assert decided(short_prompt=100) == ("pd", "long_prompt")
    assert decided({"model": "m"}, short_prompt=101) == ("pd", "long_prompt")  # unmeasured


def test_a_prompt_mostly_cached_on_decode_skips_prefill() -> None:
    ids = list(range(100))  # the prompt's token ids, as vLLM rendered them
    assert decided(holdings=Known(60), token_ids=ids, uncached=41) == (
        "decode_only",
        "cached_on_decode",
    )
    assert decided(holdings=Known(60), token_ids=ids, uncached=40) == ("pd", "long_prompt")
    assert decided(holdings=Known(None), token_ids=ids, uncached=1000) == ("pd", "long_prompt")
    assert decided(holdings=None, token_ids=ids, uncached=1000) == ("pd", "long_prompt")
    # Without token ids (no render), the rule cannot count what is held.
    assert decided(holdings=Known(100), uncached=1000) == ("pd", "long_prompt")
    # Token ids are counted exactly, not estimated.
    assert decided({"prompt": "a"}, token_ids=ids, short_prompt=101) == (
        "decode_only",
        "short_prompt",
    )


def test_a_short_ish_prompt_skips_prefill_only_while_every_prefill_is_busy() -> None:
    rules = replace(RULES, busy_prompt=200, busy_at=2)
    decode = BackendPool("decode", ["http://d:1"], Clock()).instances[0]

    def with_prefill(pool: BackendPool, body: dict[str, Any] = BODY) -> Reason:
        return decide(rules, Completion(routes.COMPLETIONS, body, "r"), decode, pool).reason

    assert with_prefill(_prefill_pool(2, 2)) is Reason.PREFILL_BUSY
    assert with_prefill(_prefill_pool(2, 1)) is Reason.LONG_PROMPT
    assert with_prefill(_prefill_pool(2, 2), {"prompt": "abcd" * 200}) is Reason.LONG_PROMPT
    scraped = _prefill_pool(2, 1)
    scraped.instances[1].load = {"waiting": 1.0, "running": 5.0}  # vLLM's queue counts
    assert with_prefill(scraped) is Reason.PREFILL_BUSY
    draining = _prefill_pool(2, 0)
    draining.instances[1].draining = True  # not usable: only the busy one counts
    assert with_prefill(draining) is Reason.PREFILL_BUSY


def test_the_fallback_decides_before_any_prefill_when_none_is_usable() -> None:
    rules = replace(RULES, fallback="decode")
    decode = BackendPool("decode", ["http://d:1"], Clock()).instances[0]
    pool = _prefill_pool()
    assert (
        decide(rules, Completion(routes.COMPLETIONS, BODY, "r"), decode, pool).reason
        is Reason.ALWAYS
    )
    for instance in pool.instances:
        instance.draining = True
    decision = decide(rules, Completion(routes.COMPLETIONS, BODY, "r"), decode, pool)
    assert (decision.mode, decision.reason) == (Mode.DECODE_ONLY, Reason.PREFILL_UNAVAILABLE)
    off = decide(RULES, Completion(routes.COMPLETIONS, BODY, "r"), decode, pool)
    assert off.reason is Reason.ALWAYS  # fail closed: prefill is tried, and refuses


def test_the_uncached_rule_says_it_is_blind_and_the_summary_names_each_rule() -> None:
    assert blind_rules(RULES, decode_events=False) is None
    said = blind_rules(replace(RULES, uncached=64), decode_events=False)
    assert said is not None and "does nothing" in said
    assert blind_rules(replace(RULES, uncached=64), decode_events=True) is None
    assert describe(RULES) == "two legs always"
    every = replace(RULES, short_prompt=256, busy_prompt=1024, busy_at=4, fallback="decode")
    assert describe(every) == (
        "decode-only below 256 tokens, decode-only below 1024 tokens while prefill is busy "
        "(at 4), decode-only when no prefill instance can serve"
    )


def test_what_decode_holds_under_another_salt_is_not_counted_as_cached() -> None:
    ids = list(range(100))
    salted = dict(BODY, cache_salt="tenant-a")
    held = Known(60, salt="tenant-a")
    assert decided(salted, held, ids, uncached=41) == ("decode_only", "cached_on_decode")
    assert decided(dict(BODY, cache_salt="tenant-b"), held, ids, uncached=41)[0] == "pd"
    assert decided(BODY, held, ids, uncached=41)[0] == "pd"
