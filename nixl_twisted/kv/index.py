"""What each instance's KV cache holds, as vLLM's KV events tell it: block keys per instance.

Blocks are named by the proxy's own keys (``blocks.block_keys``), computed
the same way for the prompts it routes: a prompt's leading keys found
under an instance are the blocks that instance would not have to compute.
An instance that hashes each block with the tokens after it (vLLM 0.34's
lookahead) is matched with keys that hold them too, learned from its events.

``KvIndex`` keeps, per instance, vLLM's hash of each block to the proxy's
key, bounded by ``max_blocks`` (the oldest stored going first), and per key
the instances that hold it. Events are applied in sequence order
(``EventStream``, per instance, in ``events``); this module is pure.
Beside what the events confirmed, it keeps what ``kv-aware`` predicted
(``predictions``): the blocks a prompt just sent will fill, until the
events settle them; ``reach`` tells the two apart.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from twisted.internet.interfaces import IReactorTime

from nixl_twisted.backends.holdings import Reach
from nixl_twisted.kv.blocks import Event, Removed, Stored, block_keys, stored_keys
from nixl_twisted.kv.predictions import NOTHING, PREDICTED_LIFE, Prediction, Predictions

#: The block size predictions are keyed by while no instance of the pool has said its
#: own (instances just started): any size will do, as long as matching uses the same;
#: once the first ``BlockStored`` says the size, they are keyed again by it.
PROVISIONAL_BLOCK = 16
#: The most predictions kept to be keyed again so (the first few requests).
EARLY_LIMIT = 1024


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
        #: The tokens after each block it hashes into it, as its last ``BlockStored`` of
        #: any block carried them (vLLM 0.34's ``lookahead_token_ids``; 0: none).
        self.lookahead = 0
        #: Blocks whose parent was unknown (stored before the index listened): not indexed.
        self.orphans = 0

    def __len__(self) -> int:
        return len(self.keys)


class KvIndex:
    """For one pool: which instances hold which blocks, by the proxy's own block keys.

    With a ``clock``, it also keeps kv-aware's predictions (``predict``),
    ``life`` seconds each; without one, it predicts nothing.
    """

    def __init__(
        self, max_blocks: int, clock: IReactorTime | None = None, life: float = PREDICTED_LIFE
    ) -> None:
        #: The most blocks kept per instance; past it the oldest stored are forgotten.
        self._max_blocks = max_blocks
        self._instances: dict[str, InstanceBlocks] = {}
        #: Each key's holders, with how many of their copies (media) hold it.
        self._holders: dict[int, dict[str, int]] = {}
        self.predictions = Predictions(clock, max_blocks, life) if clock is not None else None
        #: Predictions made before any block size was known: (tokens, LoRA, salt, prediction).
        self._early: list[tuple[Sequence[int], str | None, str | None, Prediction]] = []

    @property
    def max_blocks(self) -> int:
        return self._max_blocks

    @max_blocks.setter
    def max_blocks(self, blocks: int) -> None:
        """A reload's bound: the next blocks stored (or predicted) past it push the oldest out."""
        self._max_blocks = blocks
        if self.predictions is not None:
            self.predictions.max_blocks = blocks

    def blocks(self, url: str) -> int:
        """How many blocks the index says ``url`` holds."""
        held = self._instances.get(url)
        return len(held) if held is not None else 0

    def block_size(self, url: str) -> int | None:
        held = self._instances.get(url)
        return held.block_size if held is not None else None

    def lookahead(self, url: str) -> int:
        """The tokens after each block ``url`` hashes into it, as its events say (0: none)."""
        held = self._instances.get(url)
        return held.lookahead if held is not None else 0

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
        if event.hashes:  # (an event with no block keyed says nothing of its lookahead)
            held.lookahead = event.lookahead
        if self._early:
            self._rekey()
        held.media.add(event.medium)
        keys = stored_keys(event, parent)
        for engine_hash, key in zip(event.hashes, keys, strict=False):
            copy = (engine_hash, event.medium)
            held.chain[engine_hash] = key
            if self.predictions is not None:
                self.predictions.settled(url, key, "confirmed")
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
        if self.predictions is not None:
            self.predictions.settled(url, key, "removed")
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
        if self.predictions is not None:
            self.predictions.clear(url)
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
        self,
        tokens: Sequence[int],
        urls: Collection[str],
        lora: str | None = None,
        salt: str | None = None,
    ) -> dict[str, int]:
        """Each of ``urls`` that holds a leading block of ``tokens`` (under ``cache_salt``
        ``salt``): how many tokens in a row."""
        matched: dict[str, int] = {}
        by_shape: dict[tuple[int, int], list[str]] = {}
        for url in urls:
            size = self.block_size(url)
            if size:
                by_shape.setdefault((size, self.lookahead(url)), []).append(url)
        for (size, ahead), group in by_shape.items():
            alive = set(group)
            keys = block_keys(tokens, size, lora, salt=salt, lookahead=ahead)
            for blocks, key in enumerate(keys, 1):
                alive &= self._holders.get(key, {}).keys()
                if not alive:
                    break
                for url in alive:
                    matched[url] = blocks * size
        return matched

    # -- predictions (kv-aware's choices, until the events settle them) -------

    def _shape_for(self, url: str) -> tuple[int, int]:
        """The block size and lookahead to key ``url``'s blocks by: its own, else its pool's,
        else provisional (no lookahead).

        An instance that has not said its block size yet (no ``BlockStored``)
        serves the same model as its pool, so it is keyed as the others are.
        """
        held = self._instances.get(url)
        if held is None or not held.block_size:
            held = next((h for h in self._instances.values() if h.block_size), None)
        if held is None or not held.block_size:
            return PROVISIONAL_BLOCK, 0
        return held.block_size, held.lookahead

    def reach(
        self,
        tokens: Sequence[int],
        urls: Collection[str],
        lora: str | None = None,
        salt: str | None = None,
    ) -> dict[str, Reach]:
        """Each of ``urls`` that holds or is predicted a leading block of ``tokens`` (under
        ``cache_salt`` ``salt``), and how many tokens in a row: confirmed by its events, and
        counting its predicted blocks too."""
        predictions = self.predictions
        if predictions is not None:
            predictions.sweep()
        reach: dict[str, Reach] = {}
        by_shape: dict[tuple[int, int], list[str]] = {}
        for url in urls:
            by_shape.setdefault(self._shape_for(url), []).append(url)
        for (size, ahead), group in by_shape.items():
            confirmed: set[str] = set(group)
            expected: set[str] = set(group)
            keys = block_keys(tokens, size, lora, salt=salt, lookahead=ahead)
            for blocks, key in enumerate(keys, 1):
                holders = self._holders.get(key, {})
                confirmed &= holders.keys()
                expected = {
                    url
                    for url in expected
                    if url in holders or (predictions is not None and predictions.live(url, key))
                }
                if not expected:
                    break
                for url in expected:
                    tokens_held = blocks * size
                    before = reach.get(url)
                    kept = before.confirmed if before is not None else 0
                    held = tokens_held if url in confirmed else kept
                    reach[url] = Reach(held, tokens_held, key)
        return reach

    def predict(
        self,
        url: str,
        tokens: Sequence[int],
        lora: str | None = None,
        expires: float | None = None,
        salt: str | None = None,
    ) -> Prediction:
        """``url`` was just sent ``tokens``: the blocks of it the index does not know it holds
        count as held (``reach``) until the events settle them or their life ends."""
        if self.predictions is None:
            return NOTHING
        holders = self._holders
        size, ahead = self._shape_for(url)
        keys = block_keys(tokens, size, lora, salt=salt, lookahead=ahead)
        new = (k for k in keys if url not in holders.get(k, {}))
        prediction = self.predictions.predict(url, new, expires)
        unsaid = not any(h.block_size for h in self._instances.values())
        if unsaid and len(self._early) < EARLY_LIMIT:  # (keyed by the provisional size)
            self._early.append((tokens, lora, salt, prediction))
        return prediction

    def _rekey(self) -> None:
        """The pool's block size is known now: what was predicted before, keyed by it.

        (A leg that fails after this withdraws the provisional keys only: the
        new ones run out their life.)
        """
        early, self._early = self._early, []
        assert self.predictions is not None
        now = self.predictions.clock.seconds()
        for tokens, lora, salt, prediction in early:
            self.predictions.withdraw(prediction, outcome=None)
            if prediction.expires > now:
                self.predict(prediction.url, tokens, lora, prediction.expires, salt)

    def withdraw(self, prediction: Prediction) -> None:
        """The leg these blocks were predicted for failed: they will not be filled."""
        if self.predictions is not None:
            self.predictions.withdraw(prediction)

    def predicted(self, url: str) -> int:
        """Blocks predicted for ``url`` that its events have not settled yet."""
        return self.predictions.count(url) if self.predictions is not None else 0

    def outcomes(self, url: str) -> dict[str, int]:
        """What became of the blocks predicted for ``url``: each outcome, counted."""
        if self.predictions is None:
            return {}
        return dict(self.predictions.outcomes.get(url, {}))

    def left(self, url: str) -> None:
        """``url`` left its pool: its blocks, its predictions and their counts are forgotten."""
        self.clear(url)
        if self.predictions is not None:
            self.predictions.outcomes.pop(url, None)
