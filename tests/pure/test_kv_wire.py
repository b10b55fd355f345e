"""vLLM's event batches decoded, and an instance's stream kept in order whatever the wire lost."""

from __future__ import annotations

import json
import re
from array import array
from pathlib import Path
from typing import Any

import msgpack
import pytest
from twisted.internet.task import Clock

from nixl_twisted.kv.blocks import Cleared, Removed, Stored, block_keys
from nixl_twisted.kv.index import KvIndex
from nixl_twisted.kv.sequence import (
    BUDGET,
    END_SEQ,
    PENDING_BYTES,
    REBUILD,
    REPLAY_TIMEOUT,
    Sequencer,
)
from nixl_twisted.kv.wire import (
    MAX_MESSAGE,
    SLICE,
    BadBatch,
    decode_batch,
    events,
    sequence,
)

A = "http://a:8100"
TOKENS = list(range(1000, 1064))


def stored_map(hashes: list[int], tokens: list[int], parent: int | None = None) -> dict[str, Any]:
    """As vLLM encodes it since mid-2026: a map tagged by "type"."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "a_field_from_the_future": 1,
    }


def ids(tokens: list[int]) -> array[int]:
    """Token ids as the decoder keeps them: four bytes each."""
    return array("I", tokens)


def batch(*events: Any) -> bytes:
    return msgpack.packb([1789095808.8, list(events), 0])


def test_both_encodings_vllm_has_used_decode_to_the_same_events() -> None:
    as_map = batch(
        stored_map([7, 8], TOKENS[:32]),
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "x": 1},
    )
    as_array = batch(
        ["BlockStored", [7, 8], None, TOKENS[:32], 16, None, "GPU"],
        ["BlockRemoved", [7], "GPU"],
        ["AllBlocksCleared"],
    )
    expected = [
        Stored((7, 8), None, ids(TOKENS[:32]), 16, None, "GPU"),
        Removed((7,), "GPU"),
        Cleared(),
    ]
    assert decode_batch(as_map) == decode_batch(as_array) == expected
    with_image = {**stored_map([7, 8], TOKENS[:32]), "extra_keys": [None, ["mm-hash-1"]]}
    assert decode_batch(batch(with_image)) == [
        Stored((7,), None, ids(TOKENS[:16]), 16, None, "GPU")
    ]  # the image's block, and what follows it, are more than their tokens
    as_bytes = decode_batch(batch({**stored_map([0], TOKENS[:16]), "block_hashes": [b"\x01" * 32]}))
    assert as_bytes == [Stored((b"\x01" * 32,), None, ids(TOKENS[:16]), 16, None, "GPU")]


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgpack.packb({"ts": 1}), batch(7), batch({"type": "BlockStored"}), batch([1])],
)
def test_what_is_not_a_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(BadBatch):
        decode_batch(payload)
    with pytest.raises(BadBatch):
        sequence(b"\x00\x01")
    assert sequence((-1).to_bytes(8, "big", signed=True)) == -1


class Recorded:
    def __init__(self, replay: bool = True) -> None:
        self.index = KvIndex(1000)
        self.clock = Clock()
        self.asked: list[int] = []
        self.counts: list[str] = []
        self.stream = Sequencer(
            self.index,
            A,
            self.clock,
            self.asked.append if replay else None,
            self.counts.append,
        )

    def held(self) -> int:
        return self.index.matched(TOKENS, {A}).get(A, 0)


def block(n: int, parent: int | None = None) -> bytes:
    """The n-th block of TOKENS, stored (vLLM's hash n + 1)."""
    return batch(stored_map([n + 1], TOKENS[16 * n : 16 * n + 16], parent))


def test_batches_in_order_are_applied() -> None:
    r = Recorded()
    r.stream.live(40, block(0))  # listening since seq 40: fine, nothing was missed since
    r.stream.live(41, block(1, parent=1))
    assert r.held() == 32 and not r.stream.stale() and r.counts == []


def test_a_gap_is_filled_by_the_replay_and_what_came_meanwhile_follows() -> None:
    r = Recorded()
    r.stream.live(0, block(0))
    r.stream.live(2, block(2, parent=2))  # seq 1 lost
    assert r.asked == [1] and r.stream.stale() and r.counts == ["gap", "replay"]
    r.stream.live(3, block(3, parent=3))  # held back until the replay ends
    assert r.held() == 16
    r.stream.replayed(0, block(0))  # already applied: skipped
    r.stream.replayed(1, block(1, parent=1))
    r.stream.replayed(2, block(2, parent=2))
    r.stream.replay_ended()
    assert r.held() == 64 and r.stream.last == 3 and not r.stream.stale()


def test_a_gap_the_replay_cannot_fill_clears_the_instance_and_marks_it_stale() -> None:
    r = Recorded()
    r.stream.live(0, block(0))
    r.stream.live(5, block(1, parent=1))
    r.stream.replayed(3, block(3, parent=3))  # the buffer starts after what was lost
    r.stream.replay_ended()
    assert r.stream.stale() and r.held() == 0
    r.clock.advance(REBUILD)
    assert not r.stream.stale()


def test_without_a_replay_endpoint_a_gap_clears_and_stales_at_once() -> None:
    r = Recorded(replay=False)
    r.stream.live(0, block(0))
    r.stream.live(2, block(0))
    assert r.counts == ["gap"] and r.stream.stale()
    assert r.held() == 16  # only what came after the gap
    r.stream.live(3, block(1, parent=1))
    assert r.held() == 32


def test_a_replay_that_never_answers_is_given_up() -> None:
    r = Recorded()
    r.stream.live(0, block(0))
    r.stream.live(2, block(1, parent=1))
    r.clock.advance(REPLAY_TIMEOUT + 1)
    assert r.stream.stale()  # gave up: cleared, then what was held back applied
    assert not r.stream.replaying and r.held() == 0 and r.stream.last == 2


def test_a_sequence_going_back_is_a_restarted_publisher() -> None:
    r = Recorded()
    r.stream.live(7, block(0))
    r.stream.live(0, batch(stored_map([99], TOKENS[16:32])))  # a new process, a new cache
    assert r.counts == ["restart"] and r.held() == 0 and not r.stream.stale()
    r.stream.live(1, block(0))
    assert r.held() == 16


def test_a_batch_that_cannot_be_read_is_lost_like_a_gap() -> None:
    r = Recorded()
    r.stream.live(0, block(0))
    r.stream.live(1, b"\xc1")
    assert r.counts == ["bad"] and r.stream.stale() and r.held() == 0


REAL = json.loads((Path(__file__).parent.parent / "data" / "vllm-0.32-kv-events.json").read_text())


def frames(name: str) -> list[list[bytes]]:
    return [[bytes.fromhex(part) for part in message] for message in REAL[name]["frames"]]


@pytest.mark.parametrize("name", ["completion", "chat"])
def test_real_vllm_events_key_the_blocks_its_render_endpoint_tokenized(name: str) -> None:
    """vLLM 0.32's own frames and render answer (tests/data): the proxy's keys meet."""
    index = KvIndex(1000)
    stream = Sequencer(index, A, Clock())
    for topic, seq, payload in frames(name):
        assert topic == b"kv"
        stream.live(sequence(seq), payload)
    answer = REAL[name]["render"]["response"]
    tokens = (answer[0] if isinstance(answer, list) else answer)["token_ids"]
    assert len(tokens) > 256
    assert index.block_size(A) == 128
    assert index.matched(tokens, {A}) == {A: 256}  # two whole blocks of 128
    assert index.matched(tokens[1:], {A}) == {}


def test_real_vllm_evictions_and_replay_frames_are_read() -> None:
    index = KvIndex(1000)
    stream = Sequencer(index, A, Clock())
    counts = []
    for _, seq, payload in frames("eviction"):
        before = index.blocks(A)
        stream.live(sequence(seq), payload)
        counts.append(index.blocks(A) - before)
    assert counts[-1] == 0  # two evicted, two stored
    assert not stream.stale()
    replies = [[bytes.fromhex(p) for p in m] for m in REAL["replay_from_0"]["received"]]
    assert [len(m) for m in replies] == [4] * len(replies)
    assert replies[-1][2] == END_SEQ and replies[-1][1] == b""
    assert [sequence(m[2]) for m in replies[:-1]] == list(range(len(replies) - 1))


# -- what a publisher may not make the proxy hold or do -------------------------------


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"token_ids": [1000, "1001", *TOKENS[2:16]]}, "token_ids holds '1001'"),
        ({"token_ids": [None] * 16}, "token_ids holds None"),
        ({"token_ids": [-1] * 16}, "token_ids holds -1"),
        ({"token_ids": [2**32] * 16}, "not a token id"),
        ({"token_ids": "abc"}, "token_ids is a list"),
        ({"block_hashes": [b"\x01" * 65]}, "a block hash of 65 bytes (at most 64)"),
        ({"block_hashes": [1.5]}, "a block hash is an int or bytes"),
        ({"block_hashes": 7}, "block_hashes is a list"),
        ({"parent_block_hash": "p"}, "a block hash is an int or bytes"),
        ({"medium": "G" * 33}, "a medium of 33 characters (at most 32)"),
        ({"block_size": 0}, "block_size is 0"),
        ({"block_size": True}, "block_size is True"),
    ],
)
def test_a_block_stored_the_index_could_not_key_is_refused_with_its_reason(
    change: dict[str, Any], reason: str
) -> None:
    with pytest.raises(BadBatch, match=re.escape(reason)):
        decode_batch(batch({**stored_map([7], TOKENS[:16]), **change}))


def test_a_message_over_the_cap_is_refused_before_it_is_decoded() -> None:
    with pytest.raises(BadBatch, match=f"at most {MAX_MESSAGE}"):
        decode_batch(b"\x00" * (MAX_MESSAGE + 1))


def test_a_long_event_comes_in_pieces_that_key_the_same_blocks() -> None:
    tokens = [1000 + n % 5000 for n in range(16 * (2 * SLICE + 10))]
    hashes = list(range(1, 2 * SLICE + 11))
    pieces = list(events(batch(stored_map(hashes, tokens))))
    assert [len(p.hashes) for p in pieces if isinstance(p, Stored)] == [SLICE, SLICE, 10]
    assert [p.parent for p in pieces if isinstance(p, Stored)] == [None, SLICE, 2 * SLICE]
    index = KvIndex(10 * SLICE)
    index.apply(A, pieces)
    assert index.matched(tokens, {A}) == {A: len(tokens)}
    removed = list(events(batch({"type": "BlockRemoved", "block_hashes": hashes})))
    assert [len(p.hashes) for p in removed if isinstance(p, Removed)] == [SLICE, SLICE, 10]


def test_a_malformed_batch_is_counted_and_skipped_and_the_stream_follows_on() -> None:
    r = Recorded()
    r.stream.live(0, block(0))
    bad = {**stored_map([2], TOKENS[16:32], parent=1), "token_ids": [None, *TOKENS[17:32]]}
    r.stream.live(1, batch(bad))
    assert r.counts == ["bad"] and r.stream.bad == 1
    assert r.stream.last_bad == "token_ids holds None, not a token id"
    assert r.stream.stale() and r.held() == 0  # what it said is lost: as after a gap
    r.stream.live(2, block(0))
    r.stream.live(3, block(1, parent=1))
    assert r.held() == 32 and r.stream.last == 3
    r.clock.advance(REBUILD)
    assert not r.stream.stale() and r.counts == ["bad"]


class Turns(Clock):
    """A clock whose ``turn()`` runs what was called for later (0 s) before it, as one
    turn of a reactor does, and no more (``Clock.advance`` would run what those call)."""

    def turn(self) -> None:
        due = [call for call in self.calls if call.getTime() <= self.seconds()]
        for call in due:
            self.calls.remove(call)
            call.called = 1
            call.func(*call.args, **call.kw)


def test_a_large_batch_is_applied_over_several_turns_of_the_reactor() -> None:
    settled: list[int] = []
    index = KvIndex(100_000)
    clock = Turns()
    stream = Sequencer(index, A, clock, settled=lambda: settled.append(index.blocks(A)))
    tokens = [1000 + n % 5000 for n in range(16 * 3 * BUDGET)]
    stream.live(0, batch(stored_map(list(range(1, 3 * BUDGET + 1)), tokens)))
    stream.live(1, batch(stored_map([10**9], TOKENS[:16])))  # taken in while the first is applied
    assert stream.busy and settled == []
    turns = [index.blocks(A)]
    while stream.busy:
        clock.turn()
        turns.append(index.blocks(A))
    assert turns == [BUDGET, 2 * BUDGET, 3 * BUDGET, 3 * BUDGET + 1]
    assert settled == [3 * BUDGET + 1]
    assert index.matched(tokens, {A}) == {A: len(tokens)}


def test_what_waits_for_a_replay_is_bounded_in_bytes_too() -> None:
    r = Recorded()
    r.stream.live(0, block(0))
    r.stream.live(2, block(2, parent=2))  # a gap: replay asked, this one held back
    big = batch(stored_map([50], [7] * 2**20))  # a MiB: a byte a token id below 128
    held = 0
    while r.stream.replaying:
        r.stream.live(3 + held, big)
        held += 1
    assert 0 < held * len(big) <= PENDING_BYTES + len(big)
    assert r.stream.stale()  # given up: what was missed cannot be known


# -- cache_salt: vLLM hashes it into a prompt's first block -------------------------

SALTED = json.loads(
    (Path(__file__).parent.parent / "data" / "vllm-0.32-kv-events-salted.json").read_text()
)


def salted_frames(name: str) -> list[list[bytes]]:
    return [[bytes.fromhex(part) for part in message] for message in SALTED[name]["frames"]]


def rendered(render: dict[str, Any]) -> list[int]:
    answer = render["response"]
    return list((answer[0] if isinstance(answer, list) else answer)["token_ids"])


def applied(*names: str) -> KvIndex:
    index = KvIndex(1000)
    stream = Sequencer(index, A, Clock())
    for name in names:
        for _, seq, payload in salted_frames(name):
            stream.live(sequence(seq), payload)
    assert not stream.stale()
    return index


def test_real_vllm_salted_events_key_the_blocks_under_their_salt() -> None:
    """vLLM 0.32's frames for one prompt unsalted, salted "tenant-a" and "tenant-b" (tests/data):
    each salt's blocks are matched under that salt alone, never under another or none."""
    tokens = rendered(SALTED["render"])
    assert len(tokens) == SALTED["unsalted"]["usage"]["prompt_tokens"] == 288
    for name, salt in [("unsalted", None), ("tenant_a", "tenant-a"), ("tenant_b", "tenant-b")]:
        index = applied(name)
        for other in (None, "tenant-a", "tenant-b"):
            expected = {A: 256} if other == salt else {}
            assert index.matched(tokens, {A}, salt=other) == expected, (name, other)
    both = applied("unsalted", "tenant_a", "tenant_b")
    assert both.blocks(A) == 6  # the same tokens, three namespaces
    assert SALTED["tenant_a_again"]["frames"] == []  # a hit under its salt: nothing new stored


def test_real_vllm_salted_events_carry_the_salt_on_the_first_block_only() -> None:
    (_, _, payload), *_ = salted_frames("tenant_a")
    (stored,) = decode_batch(payload)
    assert isinstance(stored, Stored) and stored.salt == "tenant-a" and len(stored.hashes) == 2
    (_, _, payload), *_ = salted_frames("unsalted")
    _, stored = decode_batch(payload)  # (the reset's AllBlocksCleared came with it)
    assert isinstance(stored, Stored) and stored.salt is None
    assert block_keys(stored.tokens, 128) != block_keys(stored.tokens, 128, salt="tenant-a")


def test_real_vllm_salted_chat_blocks_match_the_chat_render_under_the_salt() -> None:
    case = SALTED["chat_tenant_a"]
    tokens = rendered(case["render"])
    index = applied("chat_tenant_a")
    assert index.matched(tokens, {A}, salt="tenant-a") == {A: 256}
    assert index.matched(tokens, {A}) == {}


@pytest.mark.parametrize(
    ("extra", "lora", "keyed", "salt"),
    [
        ([["s"], None], None, 2, "s"),
        ([["sql", "s"], ["sql"]], "sql", 2, "s"),  # a LoRA name on every block, then the salt
        ([["sql"], ["sql"]], "sql", 2, None),
        ([None, ["s"]], None, 1, None),  # a salt is the first block's: a later one is not keyed
        ([[["mm-1", 0]], None], None, 0, None),  # an image: not keyed
        ([["s", b"embeds"], None], None, 0, None),
    ],
)
def test_extra_keys_are_keyed_when_they_are_a_lora_name_or_the_first_blocks_salt(
    extra: list[Any], lora: str | None, keyed: int, salt: str | None
) -> None:
    event = {**stored_map([7, 8], TOKENS[:32]), "extra_keys": extra, "lora_name": lora}
    (stored,) = decode_batch(batch(event))
    assert isinstance(stored, Stored)
    assert (len(stored.hashes), stored.salt) == (keyed, salt)


def test_a_salt_after_a_parent_is_not_keyed_and_a_long_one_is_refused() -> None:
    later = {**stored_map([8], TOKENS[16:32], parent=7), "extra_keys": [["s"]]}
    (stored,) = decode_batch(batch(later))
    assert isinstance(stored, Stored) and stored.hashes == ()
    with pytest.raises(BadBatch, match="a cache_salt of 1025 characters"):
        decode_batch(batch({**stored_map([7], TOKENS[:16]), "extra_keys": [["s" * 1025]]}))


def test_a_long_salted_event_keeps_its_salt_on_the_first_piece_only() -> None:
    tokens = [t % 50000 for t in range(16 * (SLICE + 1))]
    hashes = list(range(1, SLICE + 2))
    extra: list[Any] = [["s"]] + [None] * SLICE
    pieces = decode_batch(batch({**stored_map(hashes, tokens), "extra_keys": extra}))
    assert [p.salt for p in pieces if isinstance(p, Stored)] == ["s", None]
    index = KvIndex(10 * SLICE)
    index.apply(A, pieces)
    assert index.matched(tokens, {A}, salt="s") == {A: len(tokens)}
