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
) -> list[int]:
    """The key of each whole block of ``tokens``, each chained to the one before it.

    ``parent``: the key of the block these follow (None: they start the
    prompt). A key is Python's own 64-bit hash of (parent key, the block's
    token ids): fast (SipHash, in C) and, like vLLM's own hashes, seeded
    per process, so keys are never compared across processes (each
    ``--workers`` worker computes its own, from the same events).
    ``salt``: the prompt's ``cache_salt``, which vLLM hashes into its first
    block only (every later block chains from it), so it enters the root
    here; it means nothing after a ``parent``.
    """
    if parent is not None:
        key = parent
    else:
        key = hash((ROOT, lora)) if salt is None else hash((ROOT, lora, salt))
    packed = _packed(tokens)
    step = block_size * 4
    keys = []
    for start in range(0, len(packed) - step + 1, step):
        key = hash((key, packed[start : start + step]))
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


@dataclass(frozen=True)
class Removed:
    """``BlockRemoved``: blocks an instance evicted from one medium."""

    hashes: tuple[Any, ...]
    medium: str | None = None


@dataclass(frozen=True)
class Cleared:
    """``AllBlocksCleared``: the instance's whole cache is gone (a reset)."""


Event = Stored | Removed | Cleared
