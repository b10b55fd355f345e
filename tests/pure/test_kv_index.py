"""The KV index: vLLM's block events in, per instance the tokens of a prompt it holds out."""

from __future__ import annotations

import tracemalloc

from hypothesis import given
from hypothesis import strategies as st

from nixl_twisted.kv.blocks import Cleared, Removed, Stored, block_keys
from nixl_twisted.kv.index import KvIndex

A, B = "http://a:8100", "http://b:8100"
PROMPT = list(range(1000, 1040))  # 40 tokens: 2 whole blocks of 16, and 8 more


def stored(
    tokens: list[int], hashes: list[int], parent: int | None = None, size: int = 16
) -> Stored:
    return Stored(tuple(hashes), parent, tuple(tokens), size)


def test_a_prompt_matches_the_blocks_an_instance_stored_in_a_row() -> None:
    index = KvIndex(max_blocks=100)
    index.apply(A, [stored(PROMPT[:32], [7, 8])])  # vLLM's own hashes: any values
    index.apply(B, [stored(PROMPT[:16], [9])])
    assert index.matched(PROMPT, {A, B}) == {A: 32, B: 16}
    assert index.matched(PROMPT, {B}) == {B: 16}
    assert index.matched([1, *PROMPT[1:]], {A, B}) == {}  # a different first token: nothing
    assert index.blocks(A) == 2 and index.block_size(A) == 16


def test_blocks_stored_later_chain_from_their_parents_key() -> None:
    index = KvIndex(max_blocks=100)
    index.apply(A, [stored(PROMPT[:16], [7]), stored(PROMPT[16:32], [8], parent=7)])
    assert index.matched(PROMPT, {A}) == {A: 32}
    # A parent never seen (stored before the index listened): the blocks cannot be keyed.
    index.apply(B, [stored(PROMPT[16:32], [5], parent=4)])
    assert index.matched(PROMPT, {B}) == {}
    assert index.blocks(B) == 0


def test_removed_and_cleared_blocks_are_no_longer_matched() -> None:
    index = KvIndex(max_blocks=100)
    index.apply(A, [stored(PROMPT[:32], [7, 8])])
    index.apply(A, [Removed((8,))])
    assert index.matched(PROMPT, {A}) == {A: 16}
    index.apply(A, [Removed((7,)), Removed((123,))])  # an unknown hash: nothing to do
    assert index.matched(PROMPT, {A}) == {}
    index.apply(A, [stored(PROMPT[:32], [7, 8])])
    index.apply(B, [stored(PROMPT[:32], [1, 2])])
    index.apply(A, [Cleared()])
    assert index.matched(PROMPT, {A, B}) == {B: 32}
    index.clear(B)  # (an instance that left its pool)
    assert index.matched(PROMPT, {A, B}) == {} and index.urls() == [A]


def test_each_instance_keeps_at_most_max_blocks_the_oldest_going_first() -> None:
    index = KvIndex(max_blocks=2)
    index.apply(A, [stored(PROMPT[:32], [7, 8])])
    other = list(range(5000, 5016))
    index.apply(A, [stored(other, [9])])
    assert index.blocks(A) == 2
    assert index.matched(PROMPT, {A}) == {}  # its first block went: the chain is broken
    assert index.matched(other, {A}) == {A: 16}


def test_a_lora_adapters_blocks_are_its_own() -> None:
    index = KvIndex(max_blocks=100)
    index.apply(A, [Stored((7,), None, tuple(PROMPT[:16]), 16, "sql-lora")])
    assert index.matched(PROMPT, {A}) == {}
    assert index.matched(PROMPT, {A}, lora="sql-lora") == {A: 16}


def test_instances_with_other_block_sizes_are_matched_by_their_own() -> None:
    index = KvIndex(max_blocks=100)
    index.apply(A, [stored(PROMPT[:32], [7, 8], size=16)])
    index.apply(B, [stored(PROMPT[:32], [7], size=32)])
    assert index.matched(PROMPT, {A, B}) == {A: 32, B: 32}


@given(st.lists(st.integers(min_value=0, max_value=2**40), min_size=0, max_size=70))
def test_keys_depend_on_every_token_before_them(tokens: list[int]) -> None:
    keys = block_keys(tokens, 16)
    assert len(keys) == len(tokens) // 16
    assert block_keys([*tokens, 1, 2, 3], 16)[: len(keys)] == keys
    if keys:
        changed = [tokens[0] + 1, *tokens[1:]]
        assert not set(block_keys(changed, 16)) & set(keys)
        assert block_keys(tokens[16:], 16, parent=keys[0]) == keys[1:]


def test_a_block_offloaded_to_cpu_is_held_until_its_last_copy_goes() -> None:
    index = KvIndex(max_blocks=100)
    gpu = Stored((7,), None, tuple(PROMPT[:16]), 16, medium="GPU")
    cpu = Stored((7,), None, tuple(PROMPT[:16]), 16, medium="CPU")
    index.apply(A, [gpu, cpu, Removed((7,), "GPU")])
    assert index.matched(PROMPT, {A}) == {A: 16}
    index.apply(A, [Stored((8,), 7, tuple(PROMPT[16:32]), 16, medium="CPU")])
    assert index.matched(PROMPT, {A}) == {A: 32}  # chained from the CPU copy's parent
    index.apply(A, [Removed((7,), "CPU")])
    assert index.matched(PROMPT, {A}) == {}


def test_many_hashes_of_the_same_tokens_are_bounded_by_max_blocks_too() -> None:
    """vLLM's hash of a block is not its tokens: a stream of new hashes over the same
    tokens (a restarted engine, a new hash seed, a hostile publisher) must not grow
    any map past the blocks held."""
    index = KvIndex(max_blocks=100)
    for n in range(100):
        index.apply(A, [stored(PROMPT[:16], [n])])
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(100, 20_100):
        index.apply(A, [stored(PROMPT[:16], [n])])
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.blocks(A) == 100
    assert grown < 200_000, grown  # was 2 MB: every hash kept, its block long gone
    assert index.matched(PROMPT, {A}) == {A: 16}
    index.apply(A, [Removed((n,)) for n in range(20_000, 20_100)])
    assert index.matched(PROMPT, {A}) == {} and index.blocks(A) == 0
