"""vLLM's KV event batches read off the wire: checked, bounded, and decoded a piece at a time.

A batch is one ZeroMQ message ``[topic, sequence (8 bytes, big-endian),
msgpack batch]``; the batch is ``[ts, events, data_parallel_rank]``. vLLM
encodes each event as a map tagged by ``"type"`` (since mid-2026) or, in
older releases, as an array whose first item is the tag; both are read,
by field name or position, and fields this proxy does not know are
ignored. From vLLM 0.34 a ``BlockStored`` may end with
``lookahead_token_ids`` (speculative decoding's lookahead hashing): read
by name, as every field of a map. Whatever a publisher sends, a message is either events the
index can apply or a ``BadBatch`` that says why not: a message is at
most ``MAX_MESSAGE`` bytes (ZeroMQ drops a longer one before Python sees
it), a hash at most ``MAX_HASH`` bytes, a token id an unsigned 32-bit
int. ``events`` decodes a batch one event at a time and cuts a long
event into ``SLICE``-block pieces, so whoever applies them can give the
reactor a turn between pieces (``sequence``).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import msgpack

from nixl_twisted.kv.blocks import Cleared, Event, Removed, Stored

#: The most bytes one message (each of its frames) may hold: 2 MiB, about 375,000
#: token ids stored in one engine step (five bytes each past 65,535), several times
#: the largest step vLLM schedules with its defaults; and decoding its longest event,
#: the one thing done in one piece, takes about 30 ms. Set as ZeroMQ's
#: ``MAXMSGSIZE``: a longer message is dropped before Python reads a byte of it.
MAX_MESSAGE = 2 * 1024 * 1024
#: The most bytes a block hash may have: vLLM's are 64-bit ints, or 32-byte
#: SHA-256 digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
MAX_HASH = 64
#: The most characters a medium's name may have ("GPU", "CPU"): it is kept per block.
MAX_MEDIUM = 32
#: The most characters a ``cache_salt`` may have (vLLM's request field allows 1024).
MAX_SALT = 1024
#: Blocks in one piece of an event: what is applied to the index between two turns of
#: the reactor at most (a few milliseconds).
SLICE = 1024

#: Positional fields of the older array encoding (after the tag).
_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_REMOVED = ("block_hashes", "medium")


class BadBatch(ValueError):
    """A message that is not a KV event batch vLLM would send (the reason: its text)."""


def sequence(raw: bytes) -> int:
    if len(raw) != 8:
        raise BadBatch(f"a sequence number is 8 bytes, not {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def _block_hash(value: Any) -> Any:
    """vLLM's hash of a block: a 64-bit int, or bytes (``..._USE_INT_BLOCK_HASHES=0``)."""
    if isinstance(value, bytes):
        if len(value) > MAX_HASH:
            raise BadBatch(f"a block hash of {len(value)} bytes (at most {MAX_HASH})")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise BadBatch(f"a block hash is an int or bytes, not {type(value).__name__}")


def _hashes(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise BadBatch(f"block_hashes is a list, not {type(value).__name__}")
    return tuple(_block_hash(h) for h in value)


def _tokens(value: Any, name: str = "token_ids") -> array[int]:
    if not isinstance(value, list):
        raise BadBatch(f"{name} is a list, not {type(value).__name__}")
    try:
        return array("I", value)
    except (TypeError, OverflowError):
        wrong = next((t for t in value if not isinstance(t, int) or not 0 <= t < 2**32), None)
        raise BadBatch(f"{name} holds {wrong!r}, not a token id") from None


def _lookahead(value: Any, blocks: int) -> tuple[array[int], ...]:
    """vLLM 0.34's ``lookahead_token_ids``: the tokens after each block hashed into it, one
    list per block, all as long (absent or None: no lookahead hashing; vLLM before 0.34
    sends none)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) != blocks:
        size = len(value) if isinstance(value, list) else type(value).__name__
        raise BadBatch(f"lookahead_token_ids is one list per block ({blocks}), not {size}")
    lists = tuple(_tokens(tokens, "lookahead_token_ids") for tokens in value)
    if lists and (not lists[0] or any(len(tokens) != len(lists[0]) for tokens in lists)):
        lengths = sorted({len(tokens) for tokens in lists})
        raise BadBatch(f"lookahead_token_ids of {lengths} tokens, not one length of at least 1")
    return lists


def _medium(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    if len(value) > MAX_MEDIUM:
        raise BadBatch(f"a medium of {len(value)} characters (at most {MAX_MEDIUM})")
    return value


def _extra_keys(extra: Any, lora: str | None, starts: bool, blocks: int) -> tuple[int, str | None]:
    """How many leading blocks the proxy can key, and the ``cache_salt`` of the first.

    vLLM publishes each block's extra keys untagged: the LoRA name (every
    block of an adapter's prompt, which the key already holds), then image
    ``[identifier, offset]`` pairs, the ``cache_salt`` (a string, on a
    prompt's first block only) and prompt-embedding digests. The LoRA name
    and the first block's salt are keyed; a block with anything else is more
    than its tokens: it, and what follows it, is not indexed.
    """
    if not isinstance(extra, list):
        return blocks, None
    salt = None
    for i, keys in enumerate(extra[:blocks]):
        if keys is None:
            continue
        rest = list(keys) if isinstance(keys, list | tuple) else [keys]
        if lora is not None and rest and rest[0] == lora:
            rest = rest[1:]
        if not rest:
            continue
        if i == 0 and starts and len(rest) == 1 and isinstance(rest[0], str):
            if len(rest[0]) > MAX_SALT:
                raise BadBatch(f"a cache_salt of {len(rest[0])} characters (at most {MAX_SALT})")
            salt = rest[0]
            continue
        return i, salt
    return blocks, salt


def _fields(event: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(event, dict):
        tag = event.get("type")
        return str(tag), event
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        names = {"BlockStored": _STORED, "BlockRemoved": _REMOVED}.get(event[0], ())
        return event[0], dict(zip(names, event[1:], strict=False))
    raise BadBatch(f"an event is a map or an array, not {type(event).__name__}")


def decode_event(raw: Any) -> Event | None:
    """One event, or None for a kind this proxy does not index."""
    tag, fields = _fields(raw)
    try:
        if tag == "BlockStored":
            size = fields["block_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise BadBatch(f"BlockStored's block_size is {size!r}")
            hashes = _hashes(fields["block_hashes"])
            tokens = _tokens(fields["token_ids"])
            parent = fields.get("parent_block_hash")
            lora = fields.get("lora_name")
            lora = lora if isinstance(lora, str) else None
            keyed, salt = _extra_keys(fields.get("extra_keys"), lora, parent is None, len(hashes))
            ahead = _lookahead(fields.get("lookahead_token_ids"), len(hashes))
            hashes = hashes[:keyed]
            return Stored(
                hashes,
                None if parent is None else _block_hash(parent),
                tokens[: len(hashes) * size],  # (tokens past the last hash key nothing)
                size,
                lora,
                _medium(fields.get("medium")),
                salt if hashes else None,
                ahead[:keyed],
            )
        if tag == "BlockRemoved":
            return Removed(_hashes(fields["block_hashes"]), _medium(fields.get("medium")))
    except KeyError as error:
        raise BadBatch(f"{tag} without {error}") from None
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def _slices(event: Event) -> Iterator[Event]:
    """``event`` in pieces of at most ``SLICE`` blocks, each chained to the one before."""
    if isinstance(event, Stored) and len(event.hashes) > SLICE:
        size = event.block_size
        for start in range(0, len(event.hashes), SLICE):
            yield Stored(
                event.hashes[start : start + SLICE],
                event.parent if start == 0 else event.hashes[start - 1],
                event.tokens[start * size : (start + SLICE) * size],
                size,
                event.lora,
                event.medium,
                event.salt if start == 0 else None,
                event.lookahead_tokens[start : start + SLICE],
            )
    elif isinstance(event, Removed) and len(event.hashes) > SLICE:
        for start in range(0, len(event.hashes), SLICE):
            yield Removed(event.hashes[start : start + SLICE], event.medium)
    else:
        yield event


def events(payload: bytes) -> Iterator[Event]:
    """A msgpack ``[ts, events, rank]`` batch's events that this proxy indexes, in order.

    Decoded one event at a time (never the whole batch in one call), each
    cut into pieces of ``SLICE`` blocks; raises ``BadBatch`` at the first
    thing that is not what vLLM sends (the pieces before it were yielded).
    """
    if len(payload) > MAX_MESSAGE:  # (ZeroMQ refuses these first; this says so in tests)
        raise BadBatch(f"a batch of {len(payload)} bytes (at most {MAX_MESSAGE})")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=MAX_MESSAGE)
    unpacker.feed(payload)
    count = _unpacked(unpacker, _header)
    for _ in range(count):
        event = decode_event(_unpacked(unpacker, msgpack.Unpacker.unpack))
        if event is not None:
            yield from _slices(event)


def _header(unpacker: msgpack.Unpacker) -> int:
    """Reads ``[ts, events`` and returns how many events follow."""
    if unpacker.read_array_header() < 2:
        raise BadBatch("a batch is [ts, events, data_parallel_rank]")
    unpacker.skip()
    return int(unpacker.read_array_header())


def _unpacked(unpacker: msgpack.Unpacker, read: Any) -> Any:
    try:
        return read(unpacker)
    except BadBatch:
        raise
    except Exception as error:  # msgpack raises several kinds for garbage
        reason = str(error) or type(error).__name__
        raise BadBatch(f"not a msgpack batch [ts, events, rank]: {reason}") from None


def decode_batch(payload: bytes) -> list[Event]:
    """Every event of a batch at once (for tests and tools; the proxy uses ``events``)."""
    return list(events(payload))
