"""The listening side: a Twisted Web site that knows its open connections.

Knowing them lets a stopping service close every client connection and wait
until each is gone, so nothing is left half-open after shutdown (and trial
finds a clean reactor after each test).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, DeferredList
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Site


class _TrackedChannel(HTTPChannel):
    """An HTTP/1.1 channel that registers itself with its site while open."""

    factory: TrackingSite

    def connectionMade(self) -> None:
        super().connectionMade()
        self.factory._opened(self)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        try:
            super().connectionLost(reason)
        finally:
            self.factory._closed(self)


class TrackingSite(Site):
    """A ``Site`` whose open connections can all be closed, and waited for."""

    protocol = _TrackedChannel  # type: ignore[assignment]

    def __init__(self, resource: IResource, **kwargs: Any) -> None:
        super().__init__(resource, **kwargs)
        self.displayTracebacks = False
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
        """Abort every open connection; fires when all are gone."""
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
