"""The ports a proxy listens on: bound before privileges are shed, shared by ``--workers``.

A plain ``--listen`` is a stock ``strports`` service; a worker listens on
the supervisor's shared TCP ports with ``SO_REUSEPORT``. Either way the port
is kept for the readiness line, and a bind error is one line that says
where and why.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.application import strports
from twisted.application.internet import StreamServerEndpointService
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from zope.interface import implementer

from nixl_twisted.config.endpoints import tcp_address


def cannot_listen(host: str, port: int, reason: object) -> str:
    """A bind error as one line: where, and why."""
    why = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
    return f"nixlproxy: cannot listen on {host or '*'}:{port}: {why.lower()}"


def bind_error(error: CannotListenError) -> str:
    """Twisted's bind error as that line."""
    return cannot_listen(error.interface, error.port, error.socketError)


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with ``SO_REUSEPORT``, so that every worker may bind it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@implementer(IStreamServerEndpoint)
class ReusePortEndpoint:
    """A TCP endpoint whose socket shares its port with the other workers."""

    def __init__(self, reactor: Any, host: str, port: int, backlog: int = 1024) -> None:
        self.reactor = reactor
        self.host = host
        self.port = port
        self.backlog = backlog

    def listen(self, factory: IProtocolFactory) -> Deferred[IListeningPort]:
        sock = shared_socket(self.host, self.port)  # a bind error is raised here, at once
        sock.listen(self.backlog)
        sock.setblocking(False)
        try:
            port = self.reactor.adoptStreamPort(sock.fileno(), sock.family, factory)
        finally:
            sock.close()  # the reactor holds its own duplicate
        return succeed(port)


@implementer(IStreamServerEndpoint)
class Announced:
    """An endpoint that keeps the port it was bound to, for the readiness line."""

    def __init__(self, endpoint: IStreamServerEndpoint) -> None:
        self.endpoint = endpoint
        self.port: IListeningPort | None = None

    def listen(self, factory: IProtocolFactory) -> Deferred[IListeningPort]:
        return self.endpoint.listen(factory).addCallback(self._bound)

    def _bound(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        return port


def address(port: IListeningPort) -> str:
    """Where a bound port listens: ``host:port``, or a UNIX socket's path."""
    host = port.getHost()
    if hasattr(host, "port"):
        return f"{host.host}:{host.port}"  # type: ignore[attr-defined]
    name = getattr(host, "name", host)
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


def listener(
    description: str, factory: IProtocolFactory, reactor: Any, shared: bool = False
) -> StreamServerEndpointService:
    """A stock listening service; ``shared``: a worker's SO_REUSEPORT TCP port."""
    if shared:
        where = tcp_address(description)
        assert where is not None, "a worker is only ever given tcp: endpoints"
        service = StreamServerEndpointService(ReusePortEndpoint(reactor, *where), factory)
    else:
        # strports' service reports a bind error synchronously, so twistd
        # exits non-zero at once instead of serving nothing.
        service = strports.service(description, factory, reactor=reactor)
    service.endpoint = Announced(service.endpoint)
    return service
