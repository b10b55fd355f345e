"""vLLM's KV event batches read off the wire, and each instance's stream kept in sequence.

A batch is one ZeroMQ message ``[topic, sequence (8 bytes, big-endian),
msgpack batch]``; the batch is ``[ts, events, data_parallel_rank]``. vLLM
encodes each event as a map tagged by ``"type"`` (since mid-2026) or, in
older releases, as an array whose first item is the tag; both are read,
by field name or position, and fields this proxy does not know are
ignored. ``Sequencer`` applies an instance's batches to the index in
order: a gap asks the replay endpoint when there is one, and otherwise
(or when the replay cannot fill it) clears that instance's entries and
marks it stale for ``REBUILD`` seconds; a sequence number going back
(a restarted publisher) clears them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
from twisted.internet.interfaces import IReactorTime

from nixl_twisted.backends.kv_index import Cleared, Event, KvIndex, Removed, Stored

#: What a replay answers after its last batch: sequence number -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Seconds an instance's index stays stale after a gap it could not fill (its
#: entries cleared, ``kv-aware`` routing as ``cache-aware`` meanwhile).
REBUILD = 60.0
#: Batches held back while a replay is out; past it the replay is given up.
PENDING_LIMIT = 10_000
#: Seconds a replay may take before it is given up.
REPLAY_TIMEOUT = 5.0

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
    """A message that is not a KV event batch vLLM would send."""


def sequence(raw: bytes) -> int:
    if len(raw) != 8:
        raise BadBatch(f"a sequence number is 8 bytes, not {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def _block_hash(value: Any) -> Any:
    """vLLM's hash of a block: a 64-bit int, or bytes (``..._USE_INT_BLOCK_HASHES=0``)."""
    if isinstance(value, int | bytes):
        return value
    raise BadBatch(f"a block hash is an int or bytes, not {type(value).__name__}")


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
            tokens = fields["token_ids"]
            size = fields["block_size"]
            if not isinstance(size, int) or size < 1 or not isinstance(tokens, list):
                raise BadBatch("BlockStored needs token_ids and a block_size")
            parent = fields.get("parent_block_hash")
            lora = fields.get("lora_name")
            hashes = tuple(_block_hash(h) for h in fields["block_hashes"])
            # A block with extra keys (an image's hash, a cache salt) is more than its
            # tokens: it, and what follows it, is not indexed.
            extra = fields.get("extra_keys")
            if isinstance(extra, list):
                cut = next((i for i, keys in enumerate(extra) if keys is not None), None)
                if cut is not None:
                    hashes, tokens = hashes[:cut], tokens[: cut * size]
            return Stored(
                hashes,
                None if parent is None else _block_hash(parent),
                tuple(tokens),
                size,
                lora if isinstance(lora, str) else None,
                fields.get("medium") if isinstance(fields.get("medium"), str) else None,
            )
        if tag == "BlockRemoved":
            medium = fields.get("medium")
            return Removed(
                tuple(_block_hash(h) for h in fields["block_hashes"]),
                medium if isinstance(medium, str) else None,
            )
    except (KeyError, TypeError) as error:
        raise BadBatch(f"{tag}: {error!r}") from None
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> list[Event]:
    """A msgpack ``[ts, events, rank]`` batch's events that this proxy indexes, in order."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as error:  # msgpack raises several kinds for garbage
        raise BadBatch(f"not msgpack: {error}") from None
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
        raise BadBatch("a batch is [ts, events, data_parallel_rank]")
    events = (decode_event(raw) for raw in batch[1])
    return [event for event in events if event is not None]


class Sequencer:
    """One instance's batches applied to the index in order, whatever the wire lost.

    ``ask_replay(first)`` asks the instance's replay endpoint for batches
    from ``first`` on (None: it has none). ``counted(what)`` is told each
    ``gap``, ``replay``, ``restart`` and ``bad``.
    """

    def __init__(
        self,
        index: KvIndex,
        url: str,
        clock: IReactorTime,
        ask_replay: Callable[[int], object] | None = None,
        counted: Callable[[str], object] = lambda what: None,
    ) -> None:
        self.index = index
        self.url = url
        self.clock = clock
        self.ask_replay = ask_replay
        self.counted = counted
        #: The last sequence number applied (None: none yet).
        self.last: int | None = None
        #: Batches that arrived while a replay was out, applied after it.
        self.pending: list[tuple[int, list[Event]]] | None = None
        self._replay_asked = 0.0
        #: Until when the index of this instance is stale (0: it is not).
        self.stale_until = 0.0
        #: Batches applied.
        self.batches = 0

    @property
    def replaying(self) -> bool:
        return self.pending is not None

    def stale(self) -> bool:
        """Its entries may be wrong or missing: being replayed, or cleared after a gap."""
        if self._replay_late():
            self._give_up()
        return self.replaying or self.clock.seconds() < self.stale_until

    def _replay_late(self) -> bool:
        return self.replaying and self.clock.seconds() - self._replay_asked > REPLAY_TIMEOUT

    def live(self, seq: int, payload: bytes) -> None:
        """A batch from the instance's PUB socket."""
        try:
            events = decode_batch(payload)
        except BadBatch:
            self.counted("bad")
            self._lost(seq, [])  # what it said is lost: as a gap nobody can replay
            return
        if self.pending is not None:
            if len(self.pending) >= PENDING_LIMIT or self._replay_late():
                self._give_up()
            else:
                self.pending.append((seq, events))
                return
        self._next(seq, events, may_replay=True)

    def _next(self, seq: int, events: list[Event], may_replay: bool) -> None:
        if self.last is None or seq == self.last + 1:
            self._apply(seq, events)
        elif seq <= self.last:  # the publisher restarted: its cache is new too
            self.counted("restart")
            self.index.clear(self.url)
            self._apply(seq, events)
        elif may_replay and self.ask_replay is not None:
            self.counted("gap")
            self.pending = [(seq, events)]
            self._replay_asked = self.clock.seconds()
            self.counted("replay")
            self.ask_replay(self.last + 1)
        else:
            if may_replay:
                self.counted("gap")
            self._lost(seq, events)

    def _apply(self, seq: int, events: list[Event]) -> None:
        self.index.apply(self.url, events)
        self.last = seq
        self.batches += 1

    def _lost(self, seq: int, events: list[Event]) -> None:
        """Batches before ``seq`` are gone for good: forget this instance, start again."""
        self.index.clear(self.url)
        self.stale_until = self.clock.seconds() + REBUILD
        self._apply(seq, events)

    def replayed(self, seq: int, payload: bytes) -> None:
        """A batch the replay endpoint sent back."""
        if self.pending is None or self.last is None or seq <= self.last:
            return  # already applied, or no replay out
        try:
            events = decode_batch(payload)
        except BadBatch:
            self.counted("bad")
            self._lost(seq, [])
            return
        if seq == self.last + 1:
            self._apply(seq, events)
        else:  # the buffer no longer holds what was missed
            self._lost(seq, events)

    def replay_ended(self) -> None:
        """The replay's end marker: the batches held back meanwhile, in order."""
        pending, self.pending = self.pending, None
        for seq, events in pending or ():
            if self.last is None or seq > self.last:  # (the replay may have sent it already)
                self._next(seq, events, may_replay=False)

    def _give_up(self) -> None:
        """A replay that did not answer in time, or too much arrived meanwhile."""
        pending, self.pending = self.pending or [], None
        if pending:
            self._lost(*pending[0])
            for seq, events in pending[1:]:
                self._next(seq, events, may_replay=False)
