"""What each instance's KV cache holds, as vLLM's KV events tell it: block keys per instance.

Blocks are named by the proxy's own keys (``blocks.block_keys``), computed
the same way for the prompts it routes: a prompt's leading keys found
under an instance are the blocks that instance would not have to compute.

``KvIndex`` keeps, per instance, vLLM's hash of each block to the proxy's
key, bounded by ``max_blocks`` (the oldest stored going first), and per key
the instances that hold it. Events are applied in sequence order
(``EventStream``, per instance, in ``events``); this module is pure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from nixl_twisted.kv.blocks import Event, Removed, Stored, block_keys


class InstanceBlocks:
    """One instance's blocks: vLLM's hash (and medium) to the proxy's key, oldest stored first.

    A block offloaded to CPU memory is held twice (GPU and CPU) until one
    copy is removed; the instance holds it while either is left. Every map
    here holds only the hashes ``keys`` holds, so ``max_blocks`` bounds them all.
    """

    def __init__(self) -> None:
        self.keys: OrderedDict[tuple[Any, str | None], int] = OrderedDict()
        #: vLLM's hash to the proxy's key, while a copy of it is in ``keys`` (to chain from).
        self.chain: dict[Any, int] = {}
        #: The media its events have named (a handful: "GPU", "CPU", None).
        self.media: set[str | None] = set()
        #: The block size its events carry (None until the first ``BlockStored``).
        self.block_size: int | None = None
        #: Blocks whose parent was unknown (stored before the index listened): not indexed.
        self.orphans = 0

    def __len__(self) -> int:
        return len(self.keys)


class KvIndex:
    """For one pool: which instances hold which blocks, by the proxy's own block keys."""

    def __init__(self, max_blocks: int) -> None:
        #: The most blocks kept per instance; past it the oldest stored are forgotten.
        self.max_blocks = max_blocks
        self._instances: dict[str, InstanceBlocks] = {}
        #: Each key's holders, with how many of their copies (media) hold it.
        self._holders: dict[int, dict[str, int]] = {}

    def blocks(self, url: str) -> int:
        """How many blocks the index says ``url`` holds."""
        held = self._instances.get(url)
        return len(held) if held is not None else 0

    def block_size(self, url: str) -> int | None:
        held = self._instances.get(url)
        return held.block_size if held is not None else None

    def urls(self) -> list[str]:
        return list(self._instances)

    def apply(self, url: str, events: Iterable[Event]) -> None:
        """One batch of an instance's events, in order."""
        held = self._instances.setdefault(url, InstanceBlocks())
        for event in events:
            if isinstance(event, Stored):
                self._stored(url, held, event)
            elif isinstance(event, Removed):
                for engine_hash in event.hashes:
                    self._forget(url, held, (engine_hash, event.medium))
            else:
                self.clear(url)
                held = self._instances.setdefault(url, InstanceBlocks())

    def _stored(self, url: str, held: InstanceBlocks, event: Stored) -> None:
        parent = None
        if event.parent is not None:
            parent = held.chain.get(event.parent)
            if parent is None:  # chained to a block the index never saw
                held.orphans += len(event.hashes)
                return
        held.block_size = event.block_size
        held.media.add(event.medium)
        keys = block_keys(event.tokens, event.block_size, event.lora, parent)
        for engine_hash, key in zip(event.hashes, keys, strict=False):
            copy = (engine_hash, event.medium)
            held.chain[engine_hash] = key
            if copy in held.keys:
                held.keys.move_to_end(copy)
                continue
            held.keys[copy] = key
            holders = self._holders.setdefault(key, {})
            holders[url] = holders.get(url, 0) + 1
        while len(held.keys) > self.max_blocks:
            self._forget(url, held, next(iter(held.keys)))

    def _forget(self, url: str, held: InstanceBlocks, copy: tuple[Any, str | None]) -> None:
        key = held.keys.pop(copy, None)
        if key is None:
            return
        engine_hash = copy[0]
        if not any((engine_hash, medium) in held.keys for medium in held.media):
            held.chain.pop(engine_hash, None)  # (its last copy: nothing chains from it now)
        holders = self._holders.get(key)
        if holders is not None:
            left = holders.get(url, 0) - 1
            if left > 0:  # (another copy of it, or another hash of the same tokens)
                holders[url] = left
            else:
                holders.pop(url, None)
                if not holders:
                    del self._holders[key]

    def clear(self, url: str) -> None:
        """Forget every block of ``url`` (a restart, a reset, a gap, or it left the pool)."""
        held = self._instances.pop(url, None)
        if held is None:
            return
        for key in held.keys.values():
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(url, None)
                if not holders:
                    del self._holders[key]

    def matched(
        self, tokens: Sequence[int], urls: Collection[str], lora: str | None = None
    ) -> dict[str, int]:
        """Each of ``urls`` that holds a leading block of ``tokens``: how many tokens in a row."""
        matched: dict[str, int] = {}
        by_size: dict[int, list[str]] = {}
        for url in urls:
            size = self.block_size(url)
            if size:
                by_size.setdefault(size, []).append(url)
        for size, group in by_size.items():
            alive = set(group)
            for blocks, key in enumerate(block_keys(tokens, size, lora), 1):
                alive &= self._holders.get(key, {}).keys()
                if not alive:
                    break
                for url in alive:
                    matched[url] = blocks * size
        return matched
