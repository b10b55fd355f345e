"""Decode's handles: which prompt may read one, kept and claimed once, until they expire."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, fail
from twisted.internet.task import Clock

from nixl_twisted.reuse import Handle, HandleStore, scope_of
from nixl_twisted.reuse.handles import BLOCK, from_json, ids_of

PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "decode-0",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "remote_block_ids": [[1, 2, 3]],
    "remote_num_tokens": 199,
}
SCOPE = scope_of("acme", None, "m")
#: A conversation's first turn: its prompt (150 ids) and its answer (50), as decode holds them.
TURN = tuple(range(1000, 1200))


def _done(coroutine: Any) -> Any:
    """What ``coroutine`` returned (it awaits nothing that has not fired: a store alone)."""
    found: list[Any] = []
    ensureDeferred(coroutine).addCallback(found.append)
    (result,) = found
    return result


def _store(clock: Clock, lifetime: float = 120.0) -> HandleStore:
    return HandleStore(clock, lifetime)


def test_a_prompt_that_extends_what_decode_holds_finds_its_handle() -> None:
    clock = Clock()
    store = _store(clock)
    assert _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN))) == "kept"
    found = _done(store.find(SCOPE, [*TURN, 5, 6, 7]))
    assert found.why == "found" and found.handle.instance == "http://d1"


def test_a_prompt_that_differs_after_the_last_whole_block_is_a_mismatch() -> None:
    clock = Clock()
    store = _store(clock)
    _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN)))
    other = list(TURN)
    other[195] = 7  # (past 3 x 64 ids: the key matches, the ids decode holds do not)
    assert _done(store.find(SCOPE, [*other, 5])).why == "mismatch"


def test_a_prompt_that_does_not_go_past_what_decode_holds_reads_nothing() -> None:
    clock = Clock()
    store = _store(clock)
    _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN)))
    assert _done(store.find(SCOPE, TURN[:199])).why in ("none", "mismatch")
    assert _done(store.find(SCOPE, TURN[:199])).handle is None


def test_a_prompt_that_went_on_from_the_turn_but_not_from_its_answer_is_a_mismatch() -> None:
    # (a chat template that renders the answer otherwise than decode generated it)
    clock = Clock()
    store = _store(clock)
    _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN, asked=150)))
    rendered = [*TURN[:150], *range(5, 60), 9]
    assert _done(store.find(SCOPE, rendered)).why == "mismatch"
    other_turn = [*TURN[:100], *range(5, 120)]
    assert _done(store.find(SCOPE, other_turn)).why == "none"


def test_another_tenants_prompt_never_finds_it() -> None:
    clock = Clock()
    store = _store(clock)
    _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN)))
    other = scope_of("globex", None, "m")
    assert _done(store.find(other, [*TURN, 5])).why == "none"
    salted = scope_of("acme", "salt", "m")
    assert _done(store.find(salted, [*TURN, 5])).why == "none"


def test_a_handle_is_claimed_once() -> None:
    clock = Clock()
    store = _store(clock)
    _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN)))
    first = _done(store.find(SCOPE, [*TURN, 5]))
    second = _done(store.find(SCOPE, [*TURN, 6]))
    assert _done(store.claim(first)) == "used"
    assert _done(store.claim(second)) == "taken"
    assert _done(store.find(SCOPE, [*TURN, 5])).why == "none"


def test_a_handle_is_never_offered_past_its_lifetime_less_the_margin() -> None:
    clock = Clock()
    store = _store(clock, lifetime=120.0)
    _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN)))
    clock.advance(109.0)
    found = _done(store.find(SCOPE, [*TURN, 5]))
    assert found.why == "found"
    clock.advance(1.0)  # (10 s before decode lets its blocks go)
    assert _done(store.claim(found)) == "expired"
    assert _done(store.find(SCOPE, [*TURN, 5])).why == "expired"


def test_a_short_lifetimes_margin_is_a_third_of_it() -> None:
    assert _store(Clock(), lifetime=12.0).margin == pytest.approx(4.0)


def test_a_handle_covering_fewer_than_a_block_is_not_kept() -> None:
    clock = Clock()
    store = _store(clock)
    short = dict(PARAMS, remote_num_tokens=BLOCK - 1)
    assert _done(store.keep(SCOPE, store.made(short, "http://d1", TURN[:BLOCK]))) == "too_short"
    assert len(store) == 0


def test_covered_is_what_decode_says_it_holds_never_more_than_its_ids() -> None:
    handle = Handle(dict(PARAMS, remote_num_tokens=10_000), "http://d1", ids_of(TURN), 0.0)
    assert handle.covered == len(TURN) - 1
    assert Handle(PARAMS, "http://d1", ids_of(TURN), 0.0).covered == 199


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"params": {}, "instance": "http://d1", "tokens": [1], "until": 1, "stamp": "a"}',
        b'{"params": PARAMS, "instance": 5, "tokens": [1], "until": 1, "stamp": "a"}',
        b'{"params": PARAMS, "instance": "http://d1", "tokens": [-1], "until": 1, "stamp": "a"}',
        b'{"params": PARAMS, "instance": "http://d1", "tokens": [1], "until": "x", "stamp": "a"}',
        b'{"params": PARAMS, "instance": "http://d1", "tokens": [1], "until": 1, "stamp": "a\\""}',
    ],
)
def test_what_redis_holds_is_a_handle_only_if_it_reads_as_one(raw: bytes) -> None:
    import json

    raw = raw.replace(b"PARAMS", json.dumps(PARAMS).encode())
    assert from_json(raw) is None


def test_a_handle_reads_back_as_it_was_kept() -> None:
    handle = Handle(PARAMS, "http://d1", ids_of(TURN), 12.5, "abc123")
    assert from_json(handle.to_json().encode()) == handle


def test_a_new_conversation_that_shares_only_the_opening_is_no_mismatch() -> None:
    clock = Clock()
    store = _store(clock)
    _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN, asked=150)))
    assert _done(store.find(SCOPE, [*TURN[:140], *range(5, 60)])).why == "none"


class _Away:
    """Redis that answers nothing: every call fails, or never fires."""

    def __init__(self, available: bool, fires: bool = True) -> None:
        self.available = available
        self.fires = fires
        self.finding: Deferred[Any] = Deferred()

    def keep(self, *args: Any) -> Deferred[None]:
        return fail(Exception("timed out after it was sent"))

    def find(self, keys: Any) -> Deferred[Any]:
        return fail(Exception("away")) if self.fires else self.finding

    def claim(self, *args: Any) -> Deferred[bool]:
        return fail(Exception("away"))


def test_a_handle_redis_may_have_taken_is_not_kept_here_too() -> None:
    store = HandleStore(Clock(), 120.0, _Away(available=True))
    assert _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN))) == "kept"
    assert len(store) == 0  # (two replicas would read it)


def test_while_redis_is_away_a_replica_keeps_and_finds_its_own() -> None:
    store = HandleStore(Clock(), 120.0, _Away(available=False))
    _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", TURN)))
    assert _done(store.find(SCOPE, [*TURN, 5])).why == "found"


def test_a_lookup_whose_client_left_is_cancelled_not_answered() -> None:
    away = _Away(available=True, fires=False)
    store = HandleStore(Clock(), 120.0, away)
    finding = ensureDeferred(store.find(SCOPE, [*TURN, 5]))
    finding.cancel()
    failures: list[Any] = []
    finding.addErrback(failures.append)
    assert failures and failures[0].check(CancelledError)


def test_the_ids_kept_here_are_bounded_the_oldest_let_go_first() -> None:
    clock = Clock()
    store = _store(clock)
    store.held_ids = 2 * len(TURN)
    for start in (0, 1000, 2000):
        turn = tuple(range(start, start + len(TURN)))
        _done(store.keep(SCOPE, store.made(PARAMS, "http://d1", turn)))
    assert len(store) == 2
    assert _done(store.find(SCOPE, [*range(0, 200), 5])).why == "none"
    assert _done(store.find(SCOPE, [*range(2000, 2200), 5])).why == "found"


def sharing_an_opening() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two conversations the same to 130 ids (a system prompt), then short and apart."""
    opening = tuple(range(3000, 3130))
    return (*opening, *range(1, 11)), (*opening, *range(50, 60))


def test_conversations_the_same_to_a_keys_length_keep_their_own_handles() -> None:
    clock = Clock()
    store = _store(clock)
    first, second = sharing_an_opening()
    short = dict(PARAMS, remote_num_tokens=139)
    for turn in (first, second):
        _done(store.keep(SCOPE, store.made(short, "http://d1", turn)))
    found = [_done(store.find(SCOPE, [*turn, 7])) for turn in (first, second)]
    assert [f.why for f in found] == ["found", "found"]
    assert [tuple(f.handle.tokens) for f in found] == [first, second]
    assert [_done(store.claim(f)) for f in found] == ["used", "used"]
