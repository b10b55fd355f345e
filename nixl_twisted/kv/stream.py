"""One instance's KV events: where it publishes, its sockets, and what they have said.

``EventStream`` holds a SUB socket on the instance's events endpoint and,
with a replay endpoint, a DEALER on it; each batch goes to the instance's
``Sequencer``. Whatever arrives, the stream lives on: a message that is
not a batch is counted and its reason kept (``status``), one longer than
``MAX_MESSAGE`` is dropped by ZeroMQ with its connection, which is made
again (``zmq_reactor``), and while a batch is being applied piece by
piece neither socket is read (ZeroMQ holds at most ``QUEUED`` messages
meanwhile, then the publisher's own queue does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from nixl_twisted.backends.instances import Instance
from nixl_twisted.kv.index import KvIndex
from nixl_twisted.kv.sequence import END_SEQ, Sequencer
from nixl_twisted.kv.wire import MAX_MESSAGE, BadBatch, sequence
from nixl_twisted.kv.zmq_reactor import Frames, ZmqSocket

#: Messages ZeroMQ holds for a socket of the stream while it is not read (its
#: ``RCVHWM``): with ``MAX_MESSAGE``, what an instance may make the proxy buffer.
QUEUED = 16


@dataclass(frozen=True)
class Endpoints:
    """Where one instance publishes its events, and answers replays (None: no replay)."""

    events: str
    replay: str | None = None


def _where(spec: str, host: str, rank: int | None) -> str:
    """A port on the instance's host, or ``tcp://HOST:PORT``; plus the rank (vLLM's offset)."""
    if spec.startswith("tcp://"):
        host_part, _, port = spec.rpartition(":")
        return f"{host_part}:{int(port) + (rank or 0)}"
    return f"tcp://{host}:{int(spec) + (rank or 0)}"


def endpoints(instance: Instance, events_port: int, replay_port: int) -> Endpoints | None:
    """Where ``instance`` publishes: its own ports, else its pool's (0: none)."""
    events = instance.kv.get("kv-events") or (str(events_port) if events_port else None)
    if events is None:
        return None
    replay = instance.kv.get("kv-replay") or (str(replay_port) if replay_port else None)
    host = urlsplit(instance.base).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return Endpoints(
        _where(events, host, instance.rank),
        _where(replay, host, instance.rank) if replay else None,
    )


class EventStream:
    """One instance's events: read, kept in sequence, applied to its pool's index."""

    def __init__(
        self,
        reactor: Any,
        clock: IReactorTime,
        url: str,
        where: Endpoints,
        index: KvIndex,
        counted: Callable[[str], object],
    ) -> None:
        self.where = where
        self.counted = counted
        self.subscriber = ZmqSocket(reactor, zmq.SUB, self._live, MAX_MESSAGE, QUEUED)
        self.replayer = (
            ZmqSocket(reactor, zmq.DEALER, self._replayed, MAX_MESSAGE, QUEUED)
            if where.replay
            else None
        )
        self.sequencer = Sequencer(
            index,
            url,
            clock,
            self._ask if self.replayer is not None else None,
            counted,
            self._settled,
            reactor,
        )
        #: The events socket is connected to the publisher now.
        self.connected = False
        #: Connections lost (the publisher went away, or sent a message too long).
        self.dropped = 0
        #: Waiting for the next message to be taken in (``KvEvents.read``), and
        #: whether one has been (a live batch, or a replay's end) since they were told.
        self._waiting: list[Deferred[None]] = []
        self._owed = False
        self.subscriber.watch(self._connection)
        self.subscriber.connect(where.events)
        self.subscriber.subscribe(b"")
        if self.replayer is not None and where.replay is not None:
            self.replayer.watch(self._replay_connection)
            self.replayer.connect(where.replay)

    def _live(self, frames: Frames) -> None:
        self.connected = True  # (a message came, whatever the monitor has not said yet)
        self._owed = True
        try:
            if len(frames) != 3:
                raise BadBatch(f"a batch is 3 frames, not {len(frames)}")
            self.counted("batch")
            self.sequencer.live(sequence(frames[1]), frames[2])
        except BadBatch as error:
            self.sequencer.refused(str(error))
        self._taken_in()

    def _replayed(self, frames: Frames) -> None:
        # [b"", topic, seq, payload] since vLLM 0.26, [b"", seq, payload] before.
        parts = frames[1:] if frames and frames[0] == b"" else frames
        if len(parts) == 3:
            parts = parts[1:]
        try:
            if len(parts) != 2:
                raise BadBatch(f"a replayed batch is 3 or 4 frames, not {len(frames)}")
            raw_seq, payload = parts
            if raw_seq == END_SEQ:
                self._owed = True
                self.sequencer.replay_ended()
            else:
                self.sequencer.replayed(sequence(raw_seq), payload)
        except BadBatch as error:
            self.sequencer.refused(str(error))
        self._taken_in()

    def _taken_in(self) -> None:
        """Read on once what came is applied; until then ZeroMQ holds the rest."""
        if self.sequencer.busy:
            self.subscriber.pause()
            if self.replayer is not None:
                self.replayer.pause()
        elif self._owed:
            self._read()

    def _settled(self) -> None:
        self.subscriber.resume()
        if self.replayer is not None:
            self.replayer.resume()
        if self._owed:
            self._read()

    def _connection(self, made: bool) -> None:
        self.connected = made
        if not made:
            self._dropped()

    def _replay_connection(self, made: bool) -> None:
        if not made:
            self._dropped()

    def _dropped(self) -> None:
        self.dropped += 1
        self.counted("dropped")

    def _read(self) -> None:
        self._owed = False
        waiting, self._waiting = self._waiting, []
        for done in waiting:
            done.callback(None)

    def read(self) -> Deferred[None]:
        """Fires once the next message (live, or a replay's end) has been taken in and applied."""
        done: Deferred[None] = Deferred()
        self._waiting.append(done)
        return done

    def _ask(self, first: int) -> None:
        if self.replayer is not None:
            self.replayer.send([b"", first.to_bytes(8, "big", signed=True)])

    def state(self) -> str:
        if self.sequencer.stale():
            return "stale"
        if not self.connected:
            return "connecting"
        return "listening" if self.sequencer.last is None else "live"

    def status(self) -> dict[str, Any]:
        """What /healthcheck and the admin listing say of it (``KvEvents.status``)."""
        return {
            "endpoint": self.where.events,
            "replay": self.where.replay,
            "state": self.state(),
            "sequence": self.sequencer.last,
            "bad_messages": self.sequencer.bad,
            "last_bad": self.sequencer.last_bad,
            "dropped": self.dropped,
        }

    @property
    def closed(self) -> bool:
        """Its events socket is gone (it never should be but by ``close``)."""
        return self.subscriber.socket is None

    def close(self) -> None:
        self.sequencer.close()
        self.subscriber.close()
        if self.replayer is not None:
            self.replayer.close()
