"""vLLM 0.34's lookahead hashing: blocks keyed with the tokens after them, where events say so.

Under EAGLE-style speculative decoding vLLM 0.34 hashes each block with the
L tokens after it (``get_request_block_hasher``'s ``num_hash_lookahead_tokens``)
and ``BlockStored`` ends with them (``lookahead_token_ids``, one list per
block). The frames here are built as vLLM 0.34 encodes them: a map tagged
by ``"type"``, its fields in the class's order, the ``None`` ones with a
default left out (msgspec's ``omit_defaults``).
"""

from __future__ import annotations

import json
import re
from array import array
from pathlib import Path
from typing import Any

import msgpack
import pytest
from twisted.internet.task import Clock

from nixl_twisted.kv.blocks import ROOT, Stored, block_keys, stored_keys
from nixl_twisted.kv.index import KvIndex
from nixl_twisted.kv.wire import SLICE, BadBatch, decode_batch
from nixl_twisted.testing.prefix_cache import PrefixCache

A = "http://a:8100"
C = "http://c:8100"
SIZE = 16
PROMPT = [1000 + n for n in range(100)]

#: What msgspec makes of vLLM 0.34's own ``EventBatch(ts=1.5, events=[BlockStored(...)],
#: data_parallel_rank=0)`` (its classes, from the 0.34.0 wheel's kv_events.py): two blocks of
#: 16 after no parent, the first salted "tenant-a", session "s-1", three lookahead tokens each.
VLLM_034_FRAME = (
    "93cb3ff800000000000091de000ca474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "73920b0cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020cd03e8cd03e9cd"
    "03eacd03ebcd03eccd03edcd03eecd03efcd03f0cd03f1cd03f2cd03f3cd03f4cd03f5cd03f6cd03f7cd03"
    "f8cd03f9cd03facd03fbcd03fccd03fdcd03fecd03ffcd0400cd0401cd0402cd0403cd0404cd0405cd0406"
    "cd0407aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e61"
    "6d65c0aa65787472615f6b6579739291a874656e616e742d61c0a967726f75705f69647800aa7365737369"
    "6f6e5f6964a3732d31b36c6f6f6b61686561645f746f6b656e5f6964739293cd03f8cd03f9cd03fa93cd04"
    "08cd0409cd040a00"
)


def stored_034(
    hashes: list[int],
    tokens: list[int],
    lookahead: list[list[int]] | None,
    parent: int | None = None,
    extra: list[Any] | None = None,
    session: str | None = None,
) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM 0.34 encodes it (fields in order, defaults left out)."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extra if extra is not None else [None] * len(hashes),
        "group_idx": 0,
    }
    if session is not None:
        event["session_id"] = session
    if lookahead is not None:
        event["lookahead_token_ids"] = lookahead
    return event


def batch(*events: Any) -> bytes:
    return msgpack.packb([1.5, list(events), 0])


def stored_by_vllm(prompt: list[int], lookahead: int, hashes_from: int = 1) -> dict[str, Any]:
    """What vLLM 0.34 stores of ``prompt`` computed whole: each block it can hash (its L
    tokens after it exist), with them."""
    blocks = (len(prompt) - lookahead) // SIZE
    after = [prompt[(i + 1) * SIZE : (i + 1) * SIZE + lookahead] for i in range(blocks)]
    hashes = list(range(hashes_from, hashes_from + blocks))
    return stored_034(hashes, prompt[: blocks * SIZE], after if lookahead else None)


def test_a_034_frame_as_vllm_encodes_it_is_read_with_its_lookahead_tokens() -> None:
    tokens = list(range(1000, 1040))
    built = batch(
        stored_034(
            [11, 12],
            tokens[:32],
            [tokens[16:19], tokens[32:35]],
            extra=[["tenant-a"], None],
            session="s-1",
        )
    )
    vllm = bytes.fromhex(VLLM_034_FRAME)
    # The layout these tests build is vLLM's: the same fields in the same order (msgspec
    # writes a map's length in three bytes where msgpack-python uses one).
    ((_, (theirs,), _), (_, (ours,), _)) = (msgpack.unpackb(vllm), msgpack.unpackb(built))
    assert list(theirs.items()) == list(ours.items())
    assert decode_batch(vllm) == decode_batch(built)
    (stored,) = decode_batch(vllm)
    assert isinstance(stored, Stored)
    assert stored.hashes == (11, 12) and stored.salt == "tenant-a"
    assert stored.lookahead_tokens == (array("I", tokens[16:19]), array("I", tokens[32:35]))
    assert stored.lookahead == 3


@pytest.mark.parametrize("lookahead", [1, 3])
def test_an_events_blocks_meet_the_prompt_that_produced_them(lookahead: int) -> None:
    index = KvIndex(1000)
    index.apply(A, decode_batch(batch(stored_by_vllm(PROMPT, lookahead))))
    assert index.lookahead(A) == lookahead
    assert index.matched(PROMPT, {A}) == {A: 96}  # (100 - L) // 16 = 6 blocks
    # Keyed with what follows each block: a prompt that goes on otherwise after
    # its second block holds the first block only.
    other = [*PROMPT[:32], 7, *PROMPT[33:]]
    assert index.matched(other, {A}) == {A: 16}
    # Without lookahead the same tokens are keyed otherwise: no match.
    assert not set(block_keys(PROMPT, SIZE)) & set(block_keys(PROMPT, SIZE, lookahead=lookahead))


@pytest.mark.parametrize("lookahead", [1, 3])
def test_a_prompt_whose_last_block_lacks_its_lookahead_tokens_matches_one_block_fewer(
    lookahead: int,
) -> None:
    index = KvIndex(1000)
    index.apply(A, decode_batch(batch(stored_by_vllm(PROMPT, lookahead))))
    whole = PROMPT[:64] + PROMPT[64 : 64 + lookahead - 1]  # four blocks, the last one short
    assert index.matched(whole, {A}) == {A: 48}
    assert index.matched(PROMPT[: 64 + lookahead], {A}) == {A: 64}
    assert len(block_keys(whole, SIZE, lookahead=lookahead)) == 3


def _old_block_keys(
    tokens: list[int], size: int, parent: int | None, salt: str | None
) -> list[int]:
    """The keys as main made them before lookahead (copied): the unchanged reference."""
    key = (
        parent
        if parent is not None
        else (hash((ROOT, None)) if salt is None else hash((ROOT, None, salt)))
    )
    packed = array("I", tokens).tobytes()
    keys = []
    for start in range(0, len(packed) - size * 4 + 1, size * 4):
        key = hash((key, packed[start : start + size * 4]))
        keys.append(key)
    return keys


@pytest.mark.parametrize("field", [{}, {"lookahead_token_ids": None}])
def test_without_lookahead_blocks_are_keyed_as_before(field: dict[str, Any]) -> None:
    (stored,) = decode_batch(batch({**stored_034([1, 2, 3], PROMPT[:48], None), **field}))
    assert isinstance(stored, Stored) and stored.lookahead == 0
    assert stored_keys(stored, None) == _old_block_keys(PROMPT[:48], SIZE, None, None)
    assert block_keys(PROMPT, SIZE) == _old_block_keys(PROMPT, SIZE, None, None)
    assert block_keys(PROMPT, SIZE, salt="s") == _old_block_keys(PROMPT, SIZE, None, "s")


@pytest.mark.parametrize(
    ("data", "cases"),
    [
        ("vllm-0.32-kv-events.json", ["completion", "chat", "eviction"]),
        ("vllm-0.32-kv-events-salted.json", ["unsalted", "tenant_a", "chat_tenant_a"]),
    ],
)
def test_real_032_frames_are_keyed_as_before(data: str, cases: list[str]) -> None:
    """vLLM 0.32's own frames (tests/data) carry no lookahead: every key the index makes of
    them is the one made before lookahead was read."""
    real = json.loads((Path(__file__).parent.parent / "data" / data).read_text())
    for case in cases:
        index = KvIndex(1000)
        expected: dict[Any, int] = {}
        for _, _, payload in [[bytes.fromhex(p) for p in m] for m in real[case]["frames"]]:
            for event in decode_batch(payload):
                if isinstance(event, Stored):
                    assert event.lookahead_tokens == ()
                    parent = None if event.parent is None else expected[event.parent]
                    keys = _old_block_keys(list(event.tokens), event.block_size, parent, event.salt)
                    expected.update(zip(event.hashes, keys, strict=True))
            index.apply(A, decode_batch(payload))
        assert index.lookahead(A) == 0
        held = index._instances[A].keys
        assert held and all(expected[engine_hash] == key for (engine_hash, _), key in held.items())


@pytest.mark.parametrize(
    ("lookahead", "reason"),
    [
        ([[1016]], "one list per block (2), not 1"),
        ("x", "one list per block (2), not str"),
        ([[1016], [1032, 1033]], "lookahead_token_ids of [1, 2] tokens"),
        ([[], []], "lookahead_token_ids of [0] tokens"),
        ([[1016], [-1]], "lookahead_token_ids holds -1, not a token id"),
        ([[1016], "ab"], "lookahead_token_ids is a list, not str"),
    ],
)
def test_lookahead_tokens_vllm_would_not_send_are_refused(lookahead: Any, reason: str) -> None:
    with pytest.raises(BadBatch, match=re.escape(reason)):
        decode_batch(batch(stored_034([1, 2], PROMPT[:32], lookahead)))


def test_a_long_event_with_lookahead_comes_in_pieces_that_key_the_same_blocks() -> None:
    prompt = [n % 50000 for n in range(SIZE * (SLICE + 5) + 1)]
    pieces = decode_batch(batch(stored_by_vllm(prompt, 1)))
    assert [len(p.lookahead_tokens) for p in pieces if isinstance(p, Stored)] == [SLICE, 5]
    index = KvIndex(10 * SLICE)
    index.apply(A, pieces)
    assert index.matched(prompt, {A}) == {A: SIZE * (SLICE + 5)}


def test_each_instance_is_keyed_by_its_own_lookahead_and_a_silent_one_by_its_pools() -> None:
    index = KvIndex(1000, Clock())
    index.apply(A, decode_batch(batch(stored_by_vllm(PROMPT, 0))))
    index.apply(C, decode_batch(batch(stored_by_vllm(PROMPT, 3, hashes_from=50))))
    assert (index.lookahead(A), index.lookahead(C)) == (0, 3)
    assert index.matched(PROMPT, {A, C}) == {A: 96, C: 96}
    assert index.matched(PROMPT[:64], {A, C}) == {A: 64, C: 48}
    # An instance that has said nothing yet is predicted as its pool is keyed (the first
    # instance that reported: here C, with 3), and its own events confirm the prediction.
    fresh = KvIndex(1000, Clock())
    fresh.apply(C, decode_batch(batch(stored_by_vllm(PROMPT[:20], 3))))
    fresh.predict(A, PROMPT)
    assert fresh.predicted(A) == 6
    fresh.apply(A, decode_batch(batch(stored_by_vllm(PROMPT, 3, hashes_from=50))))
    assert fresh.predicted(A) == 0 and fresh.outcomes(A) == {"confirmed": 6}


@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_the_fakes_cache_hashes_and_publishes_as_vllm_with_lookahead(lookahead: int) -> None:
    published: list[list[dict[str, Any]]] = []
    cache = PrefixCache(SIZE, 64, on_events=published.append, lookahead=lookahead)
    assert cache.compute(PROMPT) == (0, 100)
    (event,) = published[0]
    assert ("lookahead_token_ids" in event) == bool(lookahead)
    index = KvIndex(1000)
    index.apply(A, decode_batch(batch(*published[0])))
    held = (100 - lookahead) // SIZE * SIZE
    assert index.matched(PROMPT, {A}) == {A: held}
    assert cache.compute(PROMPT) == (held, 100)  # the fake's own hits agree
    short = PROMPT[: 64 + lookahead - 1] if lookahead else PROMPT[:63]
    assert cache.compute(short)[0] == index.matched(short, {A})[A] == 48


def test_predictions_made_before_any_report_are_keyed_again_with_the_pools_lookahead() -> None:
    prompt = PROMPT[:96]  # six whole blocks, the last without a token after it
    index = KvIndex(1000, Clock())
    index.predict(A, prompt)  # no block size said yet: keyed by the provisional one
    index.apply(C, decode_batch(batch(stored_by_vllm(PROMPT[:20], 1))))  # the pool: 16, L = 1
    assert index.predicted(A) == 5
    assert index.reach(prompt, {A})[A].expected == 80
    index.apply(A, decode_batch(batch(stored_by_vllm(prompt, 1, hashes_from=50))))
    assert index.predicted(A) == 0 and index.outcomes(A) == {"confirmed": 5}
