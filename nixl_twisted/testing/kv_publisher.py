"""vLLM's KV cache events on real ZeroMQ: what a fake's prefix cache did, as vLLM 0.32 sends it.

``KvPublisher`` sends each batch as ``[topic, seq (8 bytes, big-endian),
msgpack [ts, [event, ...], data_parallel_rank]]``, numbering batches from 0,
and keeps the last ``buffer_steps`` for its replay socket (a ROUTER: a
DEALER sends ``[b"", first seq]`` and gets each kept batch from there as
``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``).

The events socket is an XPUB, not vLLM's PUB: it sends subscribers the same
frames, and it also tells the fake when a subscription arrives
(``subscribed()``), so that a test publishes only once a subscriber is
sure to get it (ZeroMQ drops what a PUB sends before a subscriber has
joined), without sleeping or probing.

``KvEventsMixin`` gives ``FakeVLLM`` its publisher and the controls that go
with it. As vLLM publishes an engine step's events once the step has run,
a prompt's events are published once its compute ends (``step``), in the
order its cache changed: a prompt routed meanwhile finds nothing reported.
The encoding is written here from vLLM's, never borrowed from the proxy's
reader (``kv_wire``), so that a mistake cannot hide on both sides;
only the reactor glue of a ZeroMQ socket (``zmq_reactor``) is shared.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from twisted.internet.defer import Deferred
from twisted.web.server import Request

from nixl_twisted.kv.zmq_reactor import ZmqSocket
from nixl_twisted.testing import answers
from nixl_twisted.testing.prefix_cache import KvEvent, PrefixCache

#: What a replay sends after its last batch: an empty topic, sequence -1, no payload.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Messages queued per peer before ZeroMQ drops them (vLLM's ``hwm`` default).
HIGH_WATER_MARK = 100_000


def _seq(number: int) -> bytes:
    return number.to_bytes(8, "big")


class KvPublisher:
    """One instance's KV event publisher: an events socket and, with ``replay``, a replay socket.

    ``listen()`` binds both on free ports of ``interface``; ``publish(events)``
    sends one batch (one engine step's events).
    """

    def __init__(
        self,
        reactor: Any,
        topic: bytes = b"kv",
        buffer_steps: int = 10_000,
        replay: bool = True,
        interface: str = "127.0.0.1",
    ) -> None:
        self.reactor = reactor
        self.topic = topic
        self.interface = interface
        #: The sequence number of the next batch.
        self.seq = 0
        #: The last ``buffer_steps`` batches, (seq, payload), for replays.
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        #: Batches sent on the events socket, and replays answered.
        self.sent = 0
        self.replays = 0
        self._skipping = 0
        self._skipped_kept = True
        #: Batches held back (``hold``), sent at ``release``.
        self.held: list[list[KvEvent]] | None = None
        self._subscriptions = 0
        self._subscribers: list[Deferred[None]] = []
        self.events_port: int | None = None
        self.replay_port: int | None = None
        self._events = self._socket(zmq.XPUB, self._subscription)
        self._replay = self._socket(zmq.ROUTER, self._replay_asked) if replay else None

    def _socket(self, kind: int, received: Any) -> ZmqSocket:
        socket = ZmqSocket(self.reactor, kind, received)
        assert socket.socket is not None
        socket.socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        if ":" in self.interface:
            socket.socket.setsockopt(zmq.IPV6, 1)
        if kind == zmq.XPUB:  # every subscription passed up, a repeated one too
            socket.socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        return socket

    def _endpoint(self) -> str:
        host = f"[{self.interface}]" if ":" in self.interface else self.interface
        return f"tcp://{host}:0"

    def listen(self) -> tuple[int, int | None]:
        """Bind the events socket (and the replay socket) on free ports; returns them."""
        self.events_port = self._events.bind(self._endpoint())
        if self._replay is not None:
            self.replay_port = self._replay.bind(self._endpoint())
        return self.events_port, self.replay_port

    def where(self, port: int | None) -> str | None:
        """``tcp://HOST:PORT`` of one of this publisher's ports (None: not bound)."""
        if port is None:
            return None
        return self._endpoint().rsplit(":", 1)[0] + f":{port}"

    def publish(self, events: list[KvEvent]) -> None:
        """One batch: numbered, kept for replays and sent (unless ``skip`` or ``hold`` say
        otherwise)."""
        if self.held is not None:
            self.held.append(events)
            return
        seq, self.seq = self.seq, self.seq + 1
        payload = msgpack.packb([self.reactor.seconds(), events, 0])
        if self._skipping:
            self._skipping -= 1
            if self._skipped_kept:
                self.buffer.append((seq, payload))
            return
        self.buffer.append((seq, payload))
        self._events.send([self.topic, _seq(seq), payload])
        self.sent += 1

    # -- what a test tells it ------------------------------------------------

    def skip(self, n: int = 1, keep: bool = True) -> None:
        """The next ``n`` batches get their sequence numbers but are not sent: a gap a
        subscriber sees at the batch after them. Kept (``keep``), a replay fills the gap;
        not kept, nothing can."""
        self._skipping = n
        self._skipped_kept = keep

    def hold(self) -> None:
        """Batches from now on wait (an engine step not run yet) until ``release``."""
        if self.held is None:
            self.held = []

    def release(self) -> None:
        """The batches held, published in order, and the next ones as they come."""
        held, self.held = self.held or [], None
        for events in held:
            self.publish(events)

    def restart(self) -> None:
        """As a restarted vLLM: the sequence back to 0 and the replay buffer empty."""
        self.seq = 0
        self.buffer.clear()
        self._skipping = 0

    def subscribed(self) -> Deferred[None]:
        """Fires once a subscription has arrived: at once for one that arrived since the
        last call, else on the next. From then on, that subscriber gets every batch."""
        waiting: Deferred[None] = Deferred()
        if self._subscriptions:
            self._subscriptions -= 1
            waiting.callback(None)
        else:
            self._subscribers.append(waiting)
        return waiting

    # -- the sockets -----------------------------------------------------------

    def _subscription(self, frames: list[bytes]) -> None:
        # XPUB_VERBOSE passes every subscription up (b"\x01" + topic); b"\x00": unsubscribed.
        if len(frames) != 1 or not frames[0].startswith(b"\x01"):
            return
        if self._subscribers:
            self._subscribers.pop(0).callback(None)
        else:
            self._subscriptions += 1

    def _replay_asked(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or self._replay is None:
            return  # vLLM ignores (and logs) a request it cannot read
        client, _, first = frames
        start = int.from_bytes(first, "big")
        self.replays += 1
        for seq, payload in list(self.buffer):
            if seq >= start:
                self._replay.send([client, b"", self.topic, _seq(seq), payload])
        self._replay.send([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._events.close()
        if self._replay is not None:
            self._replay.close()
        waiting, self._subscribers = self._subscribers, []
        for subscriber in waiting:
            subscriber.cancel()


@dataclass
class _Step:
    """One prompt's cache changes, published once its compute has ended."""

    events: list[KvEvent] = field(default_factory=list)
    ran: bool = False


class KvEventsMixin:
    """Mixed into ``FakeVLLM``: its KV event publisher, on when ``kv_events`` is."""

    kv_events: bool
    kv_replay: bool
    kv_topic: bytes
    kv_buffer_steps: int
    kv_interface: str
    kv_sources_status: int
    cache: PrefixCache

    def __init__(self) -> None:
        #: ``GET /kv_event_sources`` asked of it (counted apart, as health checks are).
        self.kv_sources_reads = 0
        #: The publisher (``skip()``, ``restart()``, ``sent``...): None until ``listen()``,
        #: and without ``kv_events``.
        self.kv_publisher: KvPublisher | None = None
        #: Steps whose events are not published yet, the first to change the cache first.
        self._steps: deque[_Step] = deque()
        self._stepping: _Step | None = None

    @property
    def kv_events_port(self) -> int | None:
        """Where the events are published (``tcp://127.0.0.1:PORT``); None: off."""
        return self.kv_publisher.events_port if self.kv_publisher is not None else None

    @property
    def kv_replay_port(self) -> int | None:
        """Where replays are answered; None: off."""
        return self.kv_publisher.replay_port if self.kv_publisher is not None else None

    def _start_kv_events(self, reactor: Any) -> None:
        if not self.kv_events or self.kv_publisher is not None:
            return
        publisher = KvPublisher(
            reactor, self.kv_topic, self.kv_buffer_steps, self.kv_replay, self.kv_interface
        )
        try:
            publisher.listen()
        except BaseException:
            publisher.close()
            raise
        self.kv_publisher = publisher

    def _stop_kv_events(self) -> None:
        publisher, self.kv_publisher = self.kv_publisher, None
        if publisher is not None:
            publisher.close()

    def _kv_changed(self, events: list[KvEvent]) -> None:
        """What the prefix cache did, published as one batch (an engine step's)."""
        if self._stepping is not None:
            self._stepping.events.extend(events)
        elif self._steps:  # (after the steps still running, in order)
            self._steps.append(_Step(events, ran=True))
        elif self.kv_publisher is not None:
            self.kv_publisher.publish(events)

    @contextmanager
    def _step(self) -> Iterator[_Step]:
        """The cache changes made inside, kept for ``_stepped`` (the step's compute ended)."""
        step = _Step()
        self._steps.append(step)
        self._stepping = step
        try:
            yield step
        finally:
            self._stepping = None

    def _stepped(self, step: _Step) -> None:
        """A step has run: its events, and those of the steps after it that ran, published."""
        step.ran = True
        while self._steps and self._steps[0].ran:
            events = self._steps.popleft().events
            if events and self.kv_publisher is not None:
                self.kv_publisher.publish(events)

    def _kv_event_sources(self, request: Request) -> bytes:
        """vLLM's ``/kv_event_sources``: its one rank's publisher as configured
        (``tcp://*:PORT``, as ``--kv-events-config`` would name it), ``{}`` with none."""
        self.kv_sources_reads += 1
        request.setHeader(b"Content-Type", b"application/json")
        if self.kv_sources_status != 200:
            request.setResponseCode(self.kv_sources_status)
            return answers.vllm_error(self.kv_sources_status, "kv_event_sources failed")
        publisher = self.kv_publisher
        if publisher is None:
            return b"{}"
        replay = publisher.replay_port
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{publisher.events_port}",
            "replay_endpoint": None if replay is None else f"tcp://*:{replay}",
            "buffer_steps": self.kv_buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": self.kv_topic.decode(),
        }
        return answers.encode({"0": config})

    def subscribed(self) -> Deferred[None]:
        """Fires once a subscriber of this fake's KV events has joined (see ``KvPublisher``)."""
        if self.kv_publisher is None:
            raise RuntimeError("this fake publishes no KV events: kv_events=True, then listen()")
        return self.kv_publisher.subscribed()

    def clear_cache(self) -> None:
        """Empty the prefix cache, as vLLM's ``/reset_prefix_cache``: ``AllBlocksCleared``."""
        self.cache.clear()

    def restart_engine(self) -> None:
        """As vLLM restarted: the cache emptied without a word, the events numbered from 0."""
        self.cache.clear(report=False)
        if self.kv_publisher is not None:
            self.kv_publisher.restart()
