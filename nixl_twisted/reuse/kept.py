"""``HandleStore``: decode's handles kept until a next turn reads one, or they expire.

Each handle is read at most once (vLLM answers a handle read twice with
wrong KV and a 200): a request first *finds* the one its prompt extends
(``find``: placing then sends its decode leg to that instance) and
*claims* it only when its prefill leg goes (``claim``), so that a
follow-up decided decode-only leaves it for the turn after. With
``--replicas-redis`` the handles are the fleet's (``shared``): kept in
Redis, found there and claimed there atomically, so that two replicas
never both read one; while Redis is away a replica keeps and finds its own.
"""

from __future__ import annotations

import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Protocol, TypeVar

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime

from nixl_twisted.reuse.handles import MAX_IDS, Handle, ids_of, marks, prefix_keys

T = TypeVar("T")

#: Handles one process keeps (the oldest let go first), and the ids they cover in all
#: (128 MiB of them).
LIMIT = 10_000
HELD_IDS = 16 * 1024 * 1024
#: Handles kept under one key, the newest first: conversations whose ids are the same to a
#: key's length (a long system prompt, short turns) do not take each other's place.
PER_KEY = 8


@dataclass(frozen=True)
class Looked:
    """What a lookup saw: the first key that holds handles and those that read as handles,
    the newest first, or, none found, what the first turn's mark under one of the keys says
    (``Handle.turn_mark``; None: none)."""

    key: bytes = b""
    handles: tuple[Handle, ...] = ()
    turn: str | None = None


class SharedHandles(Protocol):
    """Where every replica keeps the handles (``fleet.handles``); each call fails with
    ``Unshared`` while Redis is away, or when it does not answer in time."""

    @property
    def available(self) -> bool:
        """Redis answers now: a handle is kept there, not here."""

    def keep(
        self, key: bytes, handle: Handle, seconds: float, turn: tuple[bytes, str] | None
    ) -> Deferred[None]:
        """Kept under ``key`` for ``seconds``, before the others there (``PER_KEY`` at most),
        and its turn's mark (``Handle.turn_mark``; None: none)."""

    def find(self, keys: Sequence[bytes]) -> Deferred[Looked]:
        """The handles under the first of ``keys`` that holds any, or else what the first of
        them that marks a turn says."""

    def claim(self, key: bytes, handle: Handle) -> Deferred[bool]:
        """``handle`` taken from ``key`` if it is still there (False: read or gone)."""


@dataclass(frozen=True)
class Found:
    """What a prompt's lookup found: its handle (None: none to use) and, in a word, why
    (``found``, ``none``, ``mismatch``, ``expired``), and where it is kept."""

    why: str
    handle: Handle | None = None
    key: bytes = b""
    shared: bool = False


NOTHING = Found("none")


class HandleStore:
    """The handles this proxy keeps, by the digest of the ids they cover."""

    def __init__(
        self,
        clock: IReactorTime,
        lifetime: float,
        shared: SharedHandles | None = None,
        limit: int = LIMIT,
    ) -> None:
        """``lifetime``: decode's ``decoder_kv_blocks_ttl``; a handle is offered for that
        less a margin (``margin``)."""
        self.clock = clock
        self.lifetime = lifetime
        self.shared = shared
        self.limit = limit
        #: The ids the handles kept here cover, in all, and at most (eight bytes each).
        self._ids = 0
        self.held_ids = HELD_IDS
        self._kept: OrderedDict[bytes, list[Handle]] = OrderedDict()
        #: The turns of the handles kept here, marked (``Handle.turn_mark``).
        self._turns: OrderedDict[bytes, str] = OrderedDict()
        #: What came of this process's lookups and of the handles its decode legs answered,
        #: by outcome, and the prompt tokens the handles read covered (the status page).
        self.lookups: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.tokens_read = 0
        #: Prefill instances that failed a handle since one was last read there (warned once).
        self.failing: set[str] = set()

    @property
    def margin(self) -> float:
        """Taken off a handle's life: the time from its claim to prefill reading it (10 s,
        a third of a shorter lifetime)."""
        return min(10.0, self.lifetime / 3)

    def __len__(self) -> int:
        """The handles kept here."""
        return sum(len(kept) for kept in self._kept.values())

    def status(self, on: bool) -> dict[str, object]:
        """What the status page says of it; ``on``: ``--multi-turn-reuse``."""
        return {
            "on": on,
            "lifetime_seconds": self.lifetime,
            "shared": self.shared is not None,
            "kept_here": len(self),
            "handles": dict(self.answered),
            "lookups": dict(self.lookups),
            "tokens_read": self.tokens_read,
        }

    def made(
        self, params: dict[str, object], instance: str, tokens: Sequence[int], asked: int = 0
    ) -> Handle:
        """A handle decode answered now; ``asked``: how many of ``tokens`` were the prompt's
        (``OverflowError``: an id no vocabulary has)."""
        until = self.clock.seconds() + self.lifetime - self.margin
        return Handle(params, instance, ids_of(tokens), until, uuid.uuid4().hex, asked)

    async def keep(self, scope: bytes, handle: Handle) -> str:
        """Kept for its scope's next prompts (``kept``), or why not: it covers too few tokens
        to be worth it (``too_short``), or more than ``MAX_IDS`` (``too_long``)."""
        key = handle.key(scope)
        if key is None:
            return "too_short"
        if len(handle.tokens) > MAX_IDS:
            return "too_long"
        turn = handle.turn_mark(scope)
        if self.shared is not None and self.shared.available:
            # (a call that failed may have reached Redis all the same: kept here too, two
            # replicas could read it; lost instead, the next turn computes its prompt)
            with suppress(Exception):
                await self.shared.keep(key, handle, self.lifetime - self.margin, turn)
            return "kept"
        kept = self._kept.pop(key, [])
        kept.insert(0, handle)
        self._ids += len(handle.tokens)
        for gone in kept[PER_KEY:]:
            self._ids -= len(gone.tokens)
        self._kept[key] = kept[:PER_KEY]
        while len(self._kept) > self.limit or self._ids > self.held_ids:
            _, oldest = self._kept.popitem(last=False)
            self._ids -= sum(len(each.tokens) for each in oldest)
        if turn is not None:
            _bounded(self._turns, turn[0], turn[1], self.limit)
        return "kept"

    async def find(self, scope: bytes, prompt: Sequence[int]) -> Found:
        """The handle ``prompt`` extends, without taking it."""
        keys = prefix_keys(scope, prompt)
        if not keys:
            return NOTHING
        looked, shared = self._here(keys), False
        if not looked.key and self.shared is not None:
            try:
                there = await self.shared.find(keys)
            except CancelledError:
                raise  # (its client left)
            except Exception:
                there = Looked()  # (Redis away: only this replica's own)
            shared = bool(there.key)
            looked = there if there.key or there.turn else looked
        key = looked.key
        if not looked.handles:
            went_on = looked.turn is not None and not key and marks(looked.turn, scope, prompt)
            return Found("mismatch") if went_on else NOTHING
        extending = [handle for handle in looked.handles if handle.extends(prompt)]
        if not extending:
            return Found("mismatch", None, key, shared)
        handle = extending[0]  # (the newest: the longest the prompt extends, at that key)
        if self.clock.seconds() >= handle.until:
            return Found("expired", None, key, shared)
        return Found("found", handle, key, shared)

    def _here(self, keys: Sequence[bytes]) -> Looked:
        for key in keys:
            kept = self._kept.get(key)
            if kept:
                return Looked(key, tuple(kept))
        return Looked(turn=next((self._turns[k] for k in keys if k in self._turns), None))

    async def claim(self, found: Found) -> str:
        """Take ``found``'s handle for a prefill leg now: ``used``, or why not (``expired``,
        ``taken``: another request read it first)."""
        handle = found.handle
        assert handle is not None
        if self.clock.seconds() >= handle.until:
            return "expired"
        if not found.shared:
            kept = self._kept.get(found.key, [])
            if not any(each is handle for each in kept):
                return "taken"
            kept.remove(handle)
            if not kept:
                del self._kept[found.key]
            self._ids -= len(handle.tokens)
            return "used"
        assert self.shared is not None
        try:
            claimed = await self.shared.claim(found.key, handle)
        except CancelledError:
            raise  # (its client left)
        except Exception:
            return "taken"  # (Redis away: another replica may read it; never twice)
        return "used" if claimed else "taken"


def _bounded(kept: OrderedDict[bytes, T], key: bytes, value: T, limit: int) -> None:
    """``value`` kept under ``key`` as the newest, the oldest let go past ``limit``."""
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > limit:
        kept.popitem(last=False)
