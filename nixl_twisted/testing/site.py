"""The fake's own ``Site``: never the proxy's, so a proxy bug cannot hide on both sides."""

from __future__ import annotations

import contextlib
from typing import Any

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred, succeed
from twisted.internet.interfaces import IListeningPort
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site


class _Channel(HTTPChannel):
    factory: FakeSite

    def connectionMade(self) -> None:
        super().connectionMade()
        self.factory._opened(self)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        try:
            super().connectionLost(reason)
        finally:
            self.factory._closed(self)


class FakeSite(Site):
    """The fake's ``Site``: it knows its open connections, to report and close them."""

    protocol = _Channel  # type: ignore[assignment]

    def __init__(self, resource: Any) -> None:
        super().__init__(resource)
        self._open: dict[HTTPChannel, list[Deferred[None]]] = {}
        #: Connections accepted since the site was made (open or not).
        self.connections_accepted = 0

    def channels(self) -> list[HTTPChannel]:
        """The HTTP channels open now."""
        return list(self._open)

    def connection_lost(self, channel: HTTPChannel) -> Deferred[None]:
        """Fires when an open channel's connection is gone."""
        waiting: Deferred[None] = Deferred()
        self._open[channel].append(waiting)
        return waiting

    def close_connections(self) -> Deferred[Any]:
        """Drop every open connection; fires when all are gone."""
        waiting = [self.connection_lost(channel) for channel in self._open]
        for channel in list(self._open):
            channel.transport.abortConnection()  # type: ignore[union-attr]
        return DeferredList(waiting)

    def _opened(self, channel: HTTPChannel) -> None:
        self._open[channel] = []
        self.connections_accepted += 1

    def _closed(self, channel: HTTPChannel) -> None:
        for waiting in self._open.pop(channel, []):
            waiting.callback(None)

    def stop(self, port: IListeningPort | None) -> Deferred[Any]:
        """Stop listening on ``port`` (if any), then close every open connection."""
        if port is None:
            return succeed(None)
        return maybeDeferred(port.stopListening).addCallback(lambda _: self.close_connections())


async def cut_off(request: Request) -> None:
    """Close the connection mid-answer, as a crashing backend would."""
    if request.channel is None:
        return
    lost: Deferred[None] = request.notifyFinish()
    request.channel.loseConnection()
    with contextlib.suppress(Exception):
        await lost


def netloc(address: IPv4Address | IPv6Address) -> str:
    """``host:port`` for a URL, an IPv6 host in brackets."""
    if isinstance(address, IPv6Address):
        return f"[{address.host}]:{address.port}"
    return f"{address.host}:{address.port}"
