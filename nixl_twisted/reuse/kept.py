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
from dataclasses import dataclass
from typing import Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from nixl_twisted.reuse.handles import Handle, prefix_keys

T = TypeVar("T")

#: Handles one process keeps (the oldest let go first).
LIMIT = 10_000


@dataclass(frozen=True)
class Looked:
    """What a lookup saw: the key of the first handle found and it (None: what is kept
    there is not a handle), or, none found, whether a turn was marked under one of the keys."""

    key: bytes = b""
    handle: Handle | None = None
    turn: bool = False


class SharedHandles(Protocol):
    """Where every replica keeps the handles (``fleet.handles``); each call fails with
    ``Unshared`` while Redis is away."""

    def keep(
        self, key: bytes, handle: Handle, seconds: float, turn: bytes | None
    ) -> Deferred[None]:
        """Kept under ``key`` for ``seconds`` (a newer one under the same key replaces it),
        and its turn marked under ``turn`` (None: none to mark)."""

    def find(self, keys: Sequence[bytes]) -> Deferred[Looked]:
        """The first of ``keys`` that holds a handle, and it (None: not a handle), or else
        whether one of them marks a turn."""

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
        self._kept: OrderedDict[bytes, Handle] = OrderedDict()
        #: The turns of the handles kept here, marked (``Handle.turn_key``).
        self._turns: OrderedDict[bytes, None] = OrderedDict()
        #: What came of this process's lookups and of the handles its decode legs answered,
        #: by outcome, and the prompt tokens the handles read covered (the status page).
        self.lookups: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.tokens_read = 0

    @property
    def margin(self) -> float:
        """Taken off a handle's life: the time from its claim to prefill reading it (10 s,
        a third of a shorter lifetime)."""
        return min(10.0, self.lifetime / 3)

    def __len__(self) -> int:
        return len(self._kept)

    def status(self, on: bool) -> dict[str, object]:
        """What the status page says of it; ``on``: ``--multi-turn-reuse``."""
        return {
            "on": on,
            "lifetime_seconds": self.lifetime,
            "shared": self.shared is not None,
            "kept_here": len(self._kept),
            "handles": dict(self.answered),
            "lookups": dict(self.lookups),
            "tokens_read": self.tokens_read,
        }

    def made(
        self, params: dict[str, object], instance: str, tokens: Sequence[int], asked: int = 0
    ) -> Handle:
        """A handle decode answered now; ``asked``: how many of ``tokens`` were the prompt's."""
        until = self.clock.seconds() + self.lifetime - self.margin
        return Handle(params, instance, tuple(tokens), until, uuid.uuid4().hex, asked)

    async def keep(self, scope: bytes, handle: Handle) -> bool:
        """Kept for its scope's next prompts; False: it covers too few tokens to keep."""
        key = handle.key(scope)
        if key is None:
            return False
        turn = handle.turn_key(scope)
        if self.shared is not None:
            try:
                await self.shared.keep(key, handle, self.lifetime, turn)
                return True
            except Exception:  # (Redis away: kept here, where only this replica reads it)
                pass
        _bounded(self._kept, key, handle, self.limit)
        if turn is not None:
            _bounded(self._turns, turn, None, self.limit)
        return True

    async def find(self, scope: bytes, prompt: Sequence[int]) -> Found:
        """The handle ``prompt`` extends, without taking it."""
        keys = prefix_keys(scope, prompt)
        if not keys:
            return NOTHING
        looked, shared = self._here(keys), False
        if not looked.key and self.shared is not None:
            try:
                there = await self.shared.find(keys)
            except Exception:
                there = Looked()  # (Redis away: only this replica's own)
            shared = bool(there.key)
            looked = there if there.key or there.turn else looked
        key, handle = looked.key, looked.handle
        if handle is None:
            return Found("mismatch") if looked.turn and not key else NOTHING
        if not handle.extends(prompt):
            return Found("mismatch", None, key, shared)
        if self.clock.seconds() >= handle.until:
            return Found("expired", None, key, shared)
        return Found("found", handle, key, shared)

    def _here(self, keys: Sequence[bytes]) -> Looked:
        for key in keys:
            handle = self._kept.get(key)
            if handle is not None:
                return Looked(key, handle)
        return Looked(turn=any(key in self._turns for key in keys))

    async def claim(self, found: Found) -> str:
        """Take ``found``'s handle for a prefill leg now: ``used``, or why not (``expired``,
        ``taken``: another request read it first)."""
        handle = found.handle
        assert handle is not None
        if self.clock.seconds() >= handle.until:
            return "expired"
        if not found.shared:
            taken = self._kept.get(found.key)
            if taken is not handle:
                return "taken"
            del self._kept[found.key]
            return "used"
        assert self.shared is not None
        try:
            claimed = await self.shared.claim(found.key, handle)
        except Exception:
            return "taken"  # (Redis away: another replica may read it; never twice)
        return "used" if claimed else "taken"


def _bounded(kept: OrderedDict[bytes, T], key: bytes, value: T, limit: int) -> None:
    """``value`` kept under ``key`` as the newest, the oldest let go past ``limit``."""
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > limit:
        kept.popitem(last=False)
