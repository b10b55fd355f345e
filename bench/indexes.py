"""What the routing indexes cost: cache-aware's memory of prefixes sent, kv-aware's KV index.

``python -m bench.routing --index-memory`` and ``--kv-index-memory`` print these.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any


def index_memory(prompts: int = 100_000) -> dict[str, Any]:
    """What cache-aware keeps after choosing for ``prompts`` distinct prompts (tracemalloc):
    its memory of prefixes sent, full at ``--cache-aware-entries``."""
    import tracemalloc

    from twisted.internet.task import Clock

    from nixl_twisted.backends import policies
    from nixl_twisted.backends.pools import BackendPool
    from nixl_twisted.backends.prompt_keys import routing_for
    from nixl_twisted.backends.routing import Balance
    from nixl_twisted.config.settings import BY_NAME
    from nixl_twisted.protocol.completion import Completion

    pool = BackendPool("prefill", [f"http://p{i}:1" for i in range(4)], Clock())
    balance = BY_NAME["cache-aware-balance"].default
    pool.sent.resize(BY_NAME["cache-aware-entries"].default)
    parts = policies.Parts(Balance(balance), pool.sent)
    pool.use_policies(policies.chosen("cache-aware", parts))
    reads = policies.needs({"cache-aware"})
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(prompts):
        body = {"messages": [{"role": "user", "content": f"distinct prompt {n} " * 20}]}
        chat = Completion("/v1/chat/completions", body, str(n))
        pool.choose(routing=routing_for(reads, 512, None, chat))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"prompts": prompts, "entries": len(pool.sent), "retained_bytes": after - before}


def kv_index_memory(blocks: int = 200_000, size: int = 16) -> dict[str, Any]:
    """What kv-aware's index keeps per block, two instances holding each (tracemalloc),
    with vLLM's 64-bit hashes and with the longest hash an event may carry, and the time
    to match an 8k-token prompt against it."""
    from nixl_twisted.kv.wire import MAX_HASH

    longest, *_ = _kv_index_held(blocks, size, lambda rng: rng.randbytes(MAX_HASH))
    held, index, prompt, urls = _kv_index_held(blocks, size, lambda rng: rng.getrandbits(64))
    started = time.perf_counter()
    for _ in range(100):
        index.matched(prompt, urls)
    return {
        "blocks_per_instance": blocks,
        "bytes_per_block_per_instance": round(held / (2 * blocks)),
        f"bytes_per_block_per_instance_{MAX_HASH}_byte_hashes": round(longest / (2 * blocks)),
        "match_8800_tokens_us": round((time.perf_counter() - started) / 100 * 1e6),
    }


def _kv_index_held(
    blocks: int, size: int, new_hash: Callable[[random.Random], Any]
) -> tuple[int, Any, tuple[int, ...], tuple[str, str]]:
    import tracemalloc

    from nixl_twisted.kv.blocks import Stored
    from nixl_twisted.kv.index import KvIndex

    index = KvIndex(blocks)
    rng = random.Random(1)
    urls = ("http://a:8100", "http://b:8100")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tokens: tuple[int, ...] = ()
    for _ in range(blocks // 50):
        tokens = tuple(rng.randrange(32000) for _ in range(size * 50))
        hashes = tuple(new_hash(rng) for _ in range(50))
        for url in urls:
            index.apply(url, [Stored(hashes, None, tokens, size, None, "GPU")])
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, index, tokens * 11, urls  # the prompt: 8,800 tokens, its first 800 held
