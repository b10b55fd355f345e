"""A ZeroMQ socket read by the reactor: its messages handed over as they arrive, no thread.

pyzmq gives each socket a file descriptor (``zmq.FD``) that becomes
readable when the socket's events *change*, not while a message waits: it
is edge-triggered. So the reactor watches that descriptor, and each time it
fires (and after each send, which can change the events too) every waiting
message is read until ``zmq.EVENTS`` says none is left. txZMQ does the
same, but it has had no release since 2021 and types nothing; this is the
part of it we need (``docs/architecture.md``).

What a reader does with a message never closes the socket: an exception
is logged and the next message read. A socket may be paused (ZeroMQ then
holds what arrives, up to its high-water mark), may refuse messages
longer than ``max_message`` (ZeroMQ drops them, and the connection, before
Python sees a byte), and may be watched: told when its connections are
made and lost, and a lost one made again, which ZeroMQ itself does not do
after a protocol error such as an over-long message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from twisted.internet.interfaces import IDelayedCall, IReadDescriptor
from twisted.logger import Logger
from twisted.python.failure import Failure
from zmq.utils.monitor import parse_monitor_message
from zope.interface import implementer

log = Logger()

#: Messages read in one go before the reactor gets a turn (a burst does not starve it).
BURST = 256
#: Seconds before a connection that dropped is made again (ZeroMQ's own interval).
REDIAL = 0.1

Frames = list[bytes]


def context() -> zmq.Context[Any]:
    """The process's one ZeroMQ context (its I/O thread is ZeroMQ's own, not Python's)."""
    return zmq.Context.instance()


@implementer(IReadDescriptor)
class ZmqSocket:
    """One ZeroMQ socket in the reactor; ``received`` is called with each message's frames.

    ``kind`` is a socket type (``zmq.SUB``), or a socket made elsewhere.
    ``max_message``: the most bytes a frame may have (ZeroMQ's
    ``MAXMSGSIZE``); ``queued``: the most messages ZeroMQ holds for it
    (``RCVHWM``).
    """

    def __init__(
        self,
        reactor: Any,
        kind: int | zmq.Socket[Any],
        received: Callable[[Frames], object],
        max_message: int | None = None,
        queued: int | None = None,
    ) -> None:
        self.reactor = reactor
        socket = context().socket(kind) if isinstance(kind, int) else kind
        self.socket: zmq.Socket[Any] | None = socket
        socket.setsockopt(zmq.LINGER, 0)
        if max_message is not None:
            socket.setsockopt(zmq.MAXMSGSIZE, max_message)
        if queued is not None:
            socket.setsockopt(zmq.RCVHWM, queued)
        self.received = received
        #: While paused nothing is read: ZeroMQ holds it.
        self.paused = False
        self._endpoints: list[str] = []
        self._monitor: ZmqSocket | None = None
        self._connections = 0
        self._redial: IDelayedCall | None = None
        self._fd = socket.getsockopt(zmq.FD)
        reactor.addReader(self)
        self._soon()  # (what waits already would not fire the descriptor)

    def connect(self, endpoint: str) -> None:
        assert self.socket is not None
        self.socket.connect(endpoint)
        self._endpoints.append(endpoint)
        self._soon()

    def bind(self, endpoint: str) -> int:
        """Bind; ``tcp://HOST:0`` binds a free port. Returns the port bound."""
        assert self.socket is not None
        if endpoint.endswith(":0"):
            return int(self.socket.bind_to_random_port(endpoint.rsplit(":", 1)[0]))
        self.socket.bind(endpoint)
        return int(endpoint.rsplit(":", 1)[1])

    def subscribe(self, topic: bytes = b"") -> None:
        assert self.socket is not None
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self._soon()

    def send(self, frames: Sequence[bytes]) -> None:
        """Queue a message (never blocks: a full queue drops it, as PUB does)."""
        if self.socket is None:
            return
        with contextlib.suppress(zmq.Again):
            self.socket.send_multipart(list(frames), zmq.NOBLOCK)
        self._soon()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self._soon()  # (what waits does not fire the descriptor again)

    # -- connections -----------------------------------------------------------

    def watch(self, changed: Callable[[bool], object]) -> None:
        """``changed(True)`` as a connection is made (its handshake done), ``changed(False)``
        as one is lost; a lost one is made again ``REDIAL`` s later unless ZeroMQ has."""
        assert self.socket is not None and self._monitor is None
        pair = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self._monitor = ZmqSocket(self.reactor, pair, lambda frames: self._seen(frames, changed))

    def _seen(self, frames: Frames, changed: Callable[[bool], object]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connections += 1
            changed(True)
        elif event == zmq.EVENT_DISCONNECTED:
            self._connections = max(0, self._connections - 1)
            changed(False)
            if self._redial is None or not self._redial.active():
                self._redial = self.reactor.callLater(REDIAL, self._dial_again)

    def _dial_again(self) -> None:
        self._redial = None
        if self.socket is None or self._connections:
            return  # (closed, or ZeroMQ made it again itself)
        for endpoint in self._endpoints:
            with contextlib.suppress(zmq.ZMQError):  # (ZeroMQ had let go of it already)
                self.socket.disconnect(endpoint)
            self.socket.connect(endpoint)
        self._soon()

    # -- the reactor's side ----------------------------------------------------

    def _soon(self) -> None:
        self.reactor.callLater(0, self.doRead)

    def fileno(self) -> int:
        return int(self._fd) if self.socket is not None else -1

    def doRead(self) -> None:
        for _ in range(BURST):
            if self.paused or self.socket is None:
                return
            try:
                if not int(self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError as error:  # (Again: taken meanwhile; else the socket is going)
                if error.errno != zmq.EAGAIN:
                    log.warn("a ZeroMQ socket could not be read: {error}", error=error)
                return
            try:
                self.received(frames)
            except Exception:
                log.failure("a ZeroMQ message could not be taken in (the next one will be)")
        self._soon()  # more may wait: after the reactor's turn

    def close(self) -> None:
        if self.socket is None:
            return
        if self._redial is not None and self._redial.active():
            self._redial.cancel()
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.socket.disable_monitor()
            self._monitor.close()
            self._monitor = None
        self.reactor.removeReader(self)
        self.socket.close(linger=0)
        self.socket = None

    def connectionLost(self, reason: Failure) -> None:
        self.close()

    def logPrefix(self) -> str:
        return "zmq"
