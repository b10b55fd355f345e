"""vLLM's event batches decoded, and an instance's stream kept in order whatever the wire lost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from twisted.internet.task import Clock

from nixl_twisted.backends.kv_index import Cleared, KvIndex, Removed, Stored
from nixl_twisted.backends.kv_wire import (
    END_SEQ,
    REBUILD,
    REPLAY_TIMEOUT,
    BadBatch,
    Sequencer,
    decode_batch,
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
        Stored((7, 8), None, tuple(TOKENS[:32]), 16, None, "GPU"),
        Removed((7,), "GPU"),
        Cleared(),
    ]
    assert decode_batch(as_map) == decode_batch(as_array) == expected
    with_image = {**stored_map([7, 8], TOKENS[:32]), "extra_keys": [None, ["mm-hash-1"]]}
    assert decode_batch(batch(with_image)) == [
        Stored((7,), None, tuple(TOKENS[:16]), 16, None, "GPU")
    ]  # the image's block, and what follows it, are more than their tokens
    as_bytes = decode_batch(batch({**stored_map([0], TOKENS[:16]), "block_hashes": [b"\x01" * 32]}))
    assert as_bytes == [Stored((b"\x01" * 32,), None, tuple(TOKENS[:16]), 16, None, "GPU")]


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
