"""The fake's prefix cache: vLLM's blocks, chained hashes, LRU, counters in tokens."""

from __future__ import annotations

from nixl_twisted.testing.prefix_cache import BYTES_PER_TOKEN, PrefixCache, prompt_text

BLOCK = 4 * BYTES_PER_TOKEN  # bytes of a block of 4 tokens


def test_a_prompt_hits_the_full_blocks_it_shares_from_the_start() -> None:
    cache = PrefixCache(block_tokens=4, capacity=100)
    first = "a" * BLOCK * 3
    assert cache.compute(first) == (0, 12)
    assert cache.compute(first + "b" * BLOCK) == (12, 16)  # its three blocks are found
    assert cache.compute("c" + first) == (0, 12)  # a different start shares nothing
    assert (cache.hits, cache.queries) == (12, 40)


def test_only_full_blocks_are_cached() -> None:
    cache = PrefixCache(block_tokens=4, capacity=100)
    cache.compute("x" * (BLOCK + BLOCK // 2))
    assert cache.compute("x" * (BLOCK + BLOCK // 2))[0] == 4


def test_the_least_recently_used_blocks_go_first() -> None:
    cache = PrefixCache(block_tokens=4, capacity=2)
    old, new = "o" * BLOCK * 2, "n" * BLOCK * 2
    cache.compute(old)
    cache.compute(new)  # evicts old's two blocks
    assert cache.usage == 1.0
    assert cache.compute(old)[0] == 0
    assert cache.compute(old)[0] == 8


def test_chat_is_rendered_as_its_messages() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(body) == "user\nhi\n"
    assert prompt_text({"prompt": [1, 2]}) == "1 2"
