"""A ZeroMQ socket read by the reactor: its messages handed over as they arrive, no thread.

pyzmq gives each socket a file descriptor (``zmq.FD``) that becomes
readable when the socket's events *change*, not while a message waits: it
is edge-triggered. So the reactor watches that descriptor, and each time it
fires (and after each send, which can change the events too) every waiting
message is read until ``zmq.EVENTS`` says none is left. txZMQ does the
same, but it has had no release since 2021 and types nothing; this is the
part of it we need (``docs/architecture.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from twisted.internet.interfaces import IReadDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

#: Messages read in one go before the reactor gets a turn (a burst does not starve it).
BURST = 256

Frames = list[bytes]


def context() -> zmq.Context[Any]:
    """The process's one ZeroMQ context (its I/O thread is ZeroMQ's own, not Python's)."""
    return zmq.Context.instance()


@implementer(IReadDescriptor)
class ZmqSocket:
    """One ZeroMQ socket in the reactor; ``received`` is called with each message's frames."""

    def __init__(self, reactor: Any, kind: int, received: Callable[[Frames], object]) -> None:
        self.reactor = reactor
        self.socket: zmq.Socket[Any] | None = context().socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.received = received
        self._fd = self.socket.getsockopt(zmq.FD)
        reactor.addReader(self)

    def connect(self, endpoint: str) -> None:
        assert self.socket is not None
        self.socket.connect(endpoint)
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

    def _soon(self) -> None:
        self.reactor.callLater(0, self.doRead)

    def fileno(self) -> int:
        return int(self._fd) if self.socket is not None else -1

    def doRead(self) -> None:
        for _ in range(BURST):
            if self.socket is None or not int(self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            self.received(self.socket.recv_multipart(zmq.NOBLOCK))
        self._soon()  # more may wait: after the reactor's turn

    def close(self) -> None:
        if self.socket is None:
            return
        self.reactor.removeReader(self)
        self.socket.close(linger=0)
        self.socket = None

    def connectionLost(self, reason: Failure) -> None:
        self.close()

    def logPrefix(self) -> str:
        return "zmq"
