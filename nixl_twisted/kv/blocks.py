"""KV blocks as the proxy names them, and vLLM's events about them as ``wire`` decodes them.

vLLM names a block by its own hash (seeded per process, so two instances
never agree on it). The proxy names a block by a key of its own, computed
from the block's token ids and its parent's key (``block_keys``), the same
way for the prompts it routes. ``Stored``, ``Removed`` and ``Cleared`` are
vLLM's events, decoded by ``wire``, ordered by ``sequence`` and applied by
``index``. Pure.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: What the key of a prompt's first block chains from, with its LoRA adapter's name
#: and its ``cache_salt``.
ROOT = "nixl-twisted kv"


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    lora: str | None = None,
    parent: int | None = None,
    salt: str | None = None,
    lookahead: int = 0,
) -> list[int]:
    """The key of each whole block of ``tokens``, each chained to the one before it.

    ``parent``: the key of the block these follow (None: they start the
    prompt). A key is Python's own 64-bit hash of (parent key, the block's
    token ids): fast (SipHash, in C) and, like vLLM's own hashes, seeded
    per process, so keys are never compared across processes (each
    ``--workers`` worker computes its own, from the same events).
    ``salt``: the prompt's ``cache_salt``, which vLLM hashes into its first
    block only (every later block chains from it), so it enters the root
    here; it means nothing after a ``parent``. ``lookahead``: the tokens
    after each block that an instance hashes into it (vLLM 0.34's lookahead
    hashing, under EAGLE-style speculative decoding): each block is then
    keyed with its next ``lookahead`` tokens too, and a block without them
    has no key (vLLM hashes it only once they exist).
    """
    packed = _packed(tokens)
    step = block_size * 4
    ahead = lookahead * 4
    after = None
    if ahead:
        ends = range(step, len(packed) - ahead + 1, step)
        after = [packed[end : end + ahead] for end in ends]
    return _chained(_root(lora, parent, salt), packed, step, after)


def stored_keys(event: Stored, parent: int | None) -> list[int]:
    """The key of each block ``event`` stored, after the block keyed ``parent`` (None: the
    first), with the tokens after each that its instance hashed into it, if any."""
    looked = event.lookahead_tokens
    after = tuple(_packed(tokens) for tokens in looked) if looked else None
    packed = _packed(event.tokens)
    return _chained(_root(event.lora, parent, event.salt), packed, event.block_size * 4, after)


def _root(lora: str | None, parent: int | None, salt: str | None) -> int:
    if parent is not None:
        return parent
    return hash((ROOT, lora)) if salt is None else hash((ROOT, lora, salt))


def _chained(key: int, packed: bytes, step: int, after: Sequence[bytes] | None) -> list[int]:
    """Each whole block of ``packed`` keyed after ``key``; with ``after``, block i's key also
    holds ``after[i]`` (blocks past the end of ``after`` have no key)."""
    keys = []
    if after is None:
        for start in range(0, len(packed) - step + 1, step):
            key = hash((key, packed[start : start + step]))
            keys.append(key)
        return keys
    for start, ahead in zip(range(0, len(packed) - step + 1, step), after, strict=False):
        key = hash((key, packed[start : start + step], ahead))
        keys.append(key)
    return keys


def _packed(tokens: Sequence[int]) -> bytes:
    """Token ids as four bytes each (ids past 32 bits, or not ids, as their low 32 bits)."""
    if isinstance(tokens, array) and tokens.typecode == "I":  # (as events are decoded)
        return tokens.tobytes()
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        return b"".join((int(t) & 0xFFFFFFFF).to_bytes(4, "little") for t in tokens)


@dataclass(frozen=True)
class Stored:
    """``BlockStored``: blocks an instance computed and now holds, after ``parent``."""

    hashes: tuple[Any, ...]
    parent: Any
    #: The blocks' token ids (``wire`` decodes them into an ``array("I")``).
    tokens: Sequence[int]
    block_size: int
    lora: str | None = None
    #: Where the blocks are kept (vLLM: "GPU", "CPU" with offloading; None: unsaid).
    medium: str | None = None
    #: The ``cache_salt`` hashed into the first block (only ever with no ``parent``).
    salt: str | None = None
    #: The tokens after each block that its instance hashed into it, one list per hash
    #: (vLLM 0.34's ``lookahead_token_ids``; empty: no lookahead hashing).
    lookahead_tokens: tuple[Sequence[int], ...] = ()

    @property
    def lookahead(self) -> int:
        """How many tokens after each block its instance hashes into it (0: none)."""
        return len(self.lookahead_tokens[0]) if self.lookahead_tokens else 0


@dataclass(frozen=True)
class Removed:
    """``BlockRemoved``: blocks an instance evicted from one medium."""

    hashes: tuple[Any, ...]
    medium: str | None = None


@dataclass(frozen=True)
class Cleared:
    """``AllBlocksCleared``: the instance's whole cache is gone (a reset)."""


Event = Stored | Removed | Cleared
