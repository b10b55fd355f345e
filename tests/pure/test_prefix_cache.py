"""The fake's prefix cache: vLLM's blocks of token ids, chained hashes, LRU, counters in tokens,
and the KV cache events it reports."""

from __future__ import annotations

from typing import Any

from nixl_twisted.testing.prefix_cache import (
    PrefixCache,
    block_removed,
    prompt_text,
    prompt_tokens,
    text_tokens,
    token_count,
)

SEED = b"a test's own seed"


def reporting(block_tokens: int = 4, capacity: int = 100) -> tuple[PrefixCache, list[Any]]:
    batches: list[Any] = []
    return PrefixCache(block_tokens, capacity, SEED, batches.append), batches


def test_a_prompt_hits_the_full_blocks_it_shares_from_the_start() -> None:
    cache = PrefixCache(block_tokens=4, capacity=100)
    first = list(range(12))
    assert cache.compute(first) == (0, 12)
    assert cache.compute([*first, 7, 7, 7, 7]) == (12, 16)  # its three blocks are found
    assert cache.compute([99, *first]) == (0, 13)  # a different start shares nothing
    assert (cache.hits, cache.queries) == (12, 41)


def test_only_full_blocks_are_cached() -> None:
    cache = PrefixCache(block_tokens=4, capacity=100)
    cache.compute(list(range(6)))
    assert cache.compute(list(range(6)))[0] == 4


def test_the_least_recently_used_blocks_go_first_a_prompts_tail_before_its_head() -> None:
    cache, batches = reporting(capacity=3)
    old, new = list(range(8)), list(range(100, 108))
    cache.compute(old)
    cache.compute(new[:4])  # one block: room for it
    assert cache.usage == 1.0
    batches.clear()
    cache.compute([*new, 9, 9, 9, 9])  # two new blocks: old's two go, its tail first
    head, tail = cache.block_hashes(old)
    assert [b for b in batches[0] if b["type"] == "BlockRemoved"] == [
        block_removed(tail),
        block_removed(head),
    ]
    assert batches[0][-1]["type"] == "BlockStored"  # evicted while allocating, then stored
    assert cache.compute(old)[0] == 0


def test_a_compute_reports_the_blocks_it_stored_after_the_ones_it_found() -> None:
    cache, batches = reporting()
    tokens = list(range(10))
    cache.compute(tokens)
    hashes = cache.block_hashes(tokens)
    assert len(hashes) == 2 and all(0 <= h < 2**64 for h in hashes)
    assert batches == [
        [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": tokens[:8],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None, None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ]
    ]
    cache.compute(tokens)  # all found: nothing new to say
    assert len(batches) == 1
    longer = [*tokens[:4], 50, 51, 52, 53, 54, 55, 56, 57]
    cache.compute(longer)
    (stored,) = batches[1]
    assert stored["parent_block_hash"] == hashes[0]
    assert stored["block_hashes"] == cache.block_hashes(longer)[1:]
    assert stored["token_ids"] == longer[4:]


def test_hashes_chain_and_are_seeded_per_cache() -> None:
    one, other = PrefixCache(4, 10), PrefixCache(4, 10)
    tokens = list(range(8))
    assert one.block_hashes(tokens) != other.block_hashes(tokens)
    assert one.block_hashes(tokens) == one.block_hashes(tokens)
    # A block's hash covers what came before it.
    assert one.block_hashes([9, 9, 9, 9, *tokens[4:]])[1] != one.block_hashes(tokens)[1]
    assert PrefixCache(4, 10, SEED).block_hashes(tokens) == PrefixCache(4, 10, SEED).block_hashes(
        tokens
    )


def test_clear_empties_it_and_says_so_unless_told_not_to() -> None:
    cache, batches = reporting()
    cache.compute(list(range(8)))
    cache.clear()
    assert batches[-1] == [{"type": "AllBlocksCleared"}]
    assert cache.usage == 0
    cache.compute(list(range(8)))
    cache.clear(report=False)
    assert batches[-1][0]["type"] == "BlockStored" and cache.usage == 0


def test_a_prompt_is_its_token_ids_or_four_bytes_of_its_text_a_token() -> None:
    assert prompt_tokens({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_tokens({"prompt": "abcdefghij"}) == [
        int.from_bytes(b"abcd", "little"),
        int.from_bytes(b"efgh", "little"),
    ]
    assert prompt_tokens({"prompt": "hi"}) == [int.from_bytes(b"hi", "little")]  # at least one
    assert prompt_tokens({"prompt": ""}) == [0]
    body = {"messages": [{"role": "user", "content": "hello there"}]}
    assert prompt_tokens(body) == text_tokens(prompt_text(body))
    for text in ("", "hi", "abcdefghij", "é" * 7, "\ud800abc"):
        assert len(text_tokens(text)) == token_count(text)


def test_chat_is_rendered_as_its_messages() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(body) == "user\nhi\n"
    assert prompt_text({"prompt": [1, 2]}) == "1 2"


def test_a_salt_namespaces_the_cache_and_its_first_block_says_it() -> None:
    cache, batches = reporting()
    prompt = list(range(8))
    assert cache.compute(prompt, "tenant-a") == (0, 8)
    assert cache.compute(prompt) == (0, 8)  # unsalted: another namespace
    assert cache.compute(prompt, "tenant-b") == (0, 8)
    assert cache.compute(prompt, "tenant-a") == (8, 8)
    stored = [batch[-1] for batch in batches]
    assert [s["extra_keys"][0] for s in stored] == [["tenant-a"], None, ["tenant-b"]]
    assert [s["extra_keys"][1] for s in stored] == [None, None, None]
    assert len({s["block_hashes"][1] for s in stored}) == 3  # every block after it differs too
