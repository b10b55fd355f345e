"""One instance's KV event batches applied to its index in order, a bounded piece at a time.

``Sequencer`` applies an instance's batches to the index in order: a gap
asks the replay endpoint when there is one, and otherwise (or when the
replay cannot fill it) clears that instance's entries and marks it stale
for ``REBUILD`` seconds; a sequence number going back (a restarted
publisher) clears them too, and so does a batch that turns out unreadable
(what it said is lost, as in a gap nobody can replay).

Applying is a queue worked ``BUDGET`` blocks at a time, the reactor
getting a turn between two goes (``wire.events`` decodes a batch one
event at a time, cut into pieces), so that a batch of the largest size
never holds the reactor for long. ``busy`` says work is left: the stream
then stops reading its sockets, and ZeroMQ holds what comes meanwhile;
``settled`` is called once none is. What waits is bounded: batches held
back during a replay by ``PENDING_LIMIT`` and ``PENDING_BYTES``, kept as
the bytes they came in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from nixl_twisted.kv.blocks import Event, Removed, Stored
from nixl_twisted.kv.index import KvIndex
from nixl_twisted.kv.wire import BadBatch, events

log = Logger()

#: What a replay answers after its last batch: sequence number -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Seconds an instance's index stays stale after a gap it could not fill (its
#: entries cleared, ``kv-aware`` routing as ``cache-aware`` meanwhile).
REBUILD = 60.0
#: Batches held back while a replay is out; past it (or past ``PENDING_BYTES`` of
#: them) the replay is given up.
PENDING_LIMIT = 10_000
PENDING_BYTES = 64 * 1024 * 1024
#: Seconds a replay may take before it is given up.
REPLAY_TIMEOUT = 5.0
#: Blocks stored or removed in one go before the reactor gets a turn (a few ms).
BUDGET = 4096
#: Seconds between two lines that say an instance's messages are refused.
SAY_EVERY = 60.0


class Sequencer:
    """One instance's batches applied to the index in order, whatever the wire lost.

    ``ask_replay(first)`` asks the instance's replay endpoint for batches
    from ``first`` on (None: it has none). ``counted(what)`` is told each
    ``gap``, ``replay``, ``restart`` and ``bad``; ``settled()`` each time
    the last batch taken in has been applied. ``turns``: what gives the
    reactor a turn between two goes (the reactor; by default ``clock``).
    """

    def __init__(
        self,
        index: KvIndex,
        url: str,
        clock: IReactorTime,
        ask_replay: Callable[[int], object] | None = None,
        counted: Callable[[str], object] = lambda what: None,
        settled: Callable[[], object] = lambda: None,
        turns: IReactorTime | None = None,
    ) -> None:
        self.index = index
        self.url = url
        self.clock = clock
        self.turns = turns if turns is not None else clock
        self.ask_replay = ask_replay
        self.counted = counted
        self.settled = settled
        #: The last sequence number taken in to be applied (None: none yet).
        self.last: int | None = None
        #: Batches that arrived while a replay was out, applied after it.
        self.pending: list[tuple[int, bytes]] | None = None
        self._pending_bytes = 0
        self._replay_asked = 0.0
        #: Until when the index of this instance is stale (0: it is not).
        self.stale_until = 0.0
        #: Batches taken in.
        self.batches = 0
        #: Messages refused (not a batch, or past a bound), and why the last one was.
        self.bad = 0
        self.last_bad: str | None = None
        self._said_bad = -SAY_EVERY
        #: Batches taken in, not applied yet; the one being applied, piece by piece.
        self._queue: deque[bytes] = deque()
        self._applying: Iterator[Event] | None = None
        self._turn: IDelayedCall | None = None
        self._working = False

    @property
    def replaying(self) -> bool:
        return self.pending is not None

    @property
    def busy(self) -> bool:
        """Batches taken in are still being applied."""
        return self._applying is not None or bool(self._queue)

    def stale(self) -> bool:
        """Its entries may be wrong or missing: being replayed, or cleared after a gap."""
        if self._replay_late():
            self._give_up()
        return self.replaying or self.clock.seconds() < self.stale_until

    def _replay_late(self) -> bool:
        return self.replaying and self.clock.seconds() - self._replay_asked > REPLAY_TIMEOUT

    def refused(self, reason: str) -> None:
        """A message that is no batch: counted, its reason kept and said (once a minute)."""
        self.bad += 1
        self.last_bad = reason
        self.counted("bad")
        now = self.clock.seconds()
        if now - self._said_bad >= SAY_EVERY:
            self._said_bad = now
            log.warn(
                "KV events of {url}: a message refused ({bad} so far): {reason}",
                url=self.url,
                bad=self.bad,
                reason=reason,
            )

    def live(self, seq: int, payload: bytes) -> None:
        """A batch from the instance's PUB socket."""
        if self.pending is not None:
            full = len(self.pending) >= PENDING_LIMIT
            if full or self._pending_bytes + len(payload) > PENDING_BYTES or self._replay_late():
                self._give_up()
            else:
                self.pending.append((seq, payload))
                self._pending_bytes += len(payload)
                return
        self._next(seq, payload, may_replay=True)

    def _next(self, seq: int, payload: bytes, may_replay: bool) -> None:
        if self.last is None or seq == self.last + 1:
            self._take(seq, payload)
        elif seq <= self.last:  # the publisher restarted: its cache is new too
            self.counted("restart")
            self._clear()
            self._take(seq, payload)
        elif may_replay and self.ask_replay is not None:
            self.counted("gap")
            self.pending, self._pending_bytes = [(seq, payload)], len(payload)
            self._replay_asked = self.clock.seconds()
            self.counted("replay")
            self.ask_replay(self.last + 1)
        else:
            if may_replay:
                self.counted("gap")
            self._lost(seq, payload)

    def _take(self, seq: int, payload: bytes) -> None:
        self.last = seq
        self.batches += 1
        self._queue.append(payload)
        self._work()

    def _clear(self) -> None:
        """Forget the instance's entries, and what of it was still to be applied."""
        self._queue.clear()
        self._applying = None
        self.index.clear(self.url)

    def _lost(self, seq: int, payload: bytes) -> None:
        """Batches before ``seq`` are gone for good: forget this instance, start again."""
        self._clear()
        self.stale_until = self.clock.seconds() + REBUILD
        self._take(seq, payload)

    def replayed(self, seq: int, payload: bytes) -> None:
        """A batch the replay endpoint sent back."""
        if self.pending is None or self.last is None or seq <= self.last:
            return  # already applied, or no replay out
        if seq == self.last + 1:
            self._take(seq, payload)
        else:  # the buffer no longer holds what was missed
            self._lost(seq, payload)

    def replay_ended(self) -> None:
        """The replay's end marker: the batches held back meanwhile, in order."""
        pending, self.pending, self._pending_bytes = self.pending, None, 0
        for seq, payload in pending or ():
            if self.last is None or seq > self.last:  # (the replay may have sent it already)
                self._next(seq, payload, may_replay=False)

    def _give_up(self) -> None:
        """A replay that did not answer in time, or too much arrived meanwhile."""
        pending, self.pending, self._pending_bytes = self.pending or [], None, 0
        if pending:
            self._lost(*pending[0])
            for seq, payload in pending[1:]:
                self._next(seq, payload, may_replay=False)

    # -- applying, a piece at a time ------------------------------------------

    def _work(self) -> None:
        """Apply what waits, ``BUDGET`` blocks now and the rest at the reactor's next turns."""
        if self._working or self._turn is not None:
            return  # (a go is under way, or set for the next turn: it takes this too)
        self._working = True
        try:
            done = 0
            while done < BUDGET and self.busy:
                done += self._step()
        finally:
            self._working = False
        if self.busy:
            self._turn = self.turns.callLater(0, self._next_turn)
        else:
            self.settled()

    def _next_turn(self) -> None:
        self._turn = None
        self._work()

    def _step(self) -> int:
        """One piece of the batch being applied (or of the next one); how many blocks."""
        if self._applying is None:
            self._applying = events(self._queue.popleft())
        try:
            event = next(self._applying, None)
        except BadBatch as error:
            self._unreadable(str(error))
            return 1
        if event is None:
            self._applying = None
            return 1
        try:
            self.index.apply(self.url, [event])
        except Exception:  # (never expected: decoding checks what the index relies on)
            log.failure("KV events of {url}: a piece could not be applied", url=self.url)
            self._unreadable("a piece the index could not apply")
            return 1
        return len(event.hashes) if isinstance(event, Stored | Removed) else 1

    def _unreadable(self, reason: str) -> None:
        """The batch being applied says what it cannot: lost, like a gap (later ones follow)."""
        self._applying = None
        self.refused(reason)
        self.index.clear(self.url)
        self.stale_until = self.clock.seconds() + REBUILD

    def close(self) -> None:
        """No more work: the instance's stream is gone."""
        if self._turn is not None and self._turn.active():
            self._turn.cancel()
        self._turn = None
        self._queue.clear()
        self._applying = None
