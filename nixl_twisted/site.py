"""The listening side: a Twisted Web site that knows its open connections.

Knowing them lets a stopping service close every client connection and wait
until each is gone, so nothing is left half-open after shutdown (and trial
finds a clean reactor after each test).
"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import Deferred, DeferredList
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from nixl_twisted.access import AccessLog
from nixl_twisted.errors import error_body
from nixl_twisted.events import Happened


class _TrackedChannel(HTTPChannel):
    """An HTTP/1.1 channel that registers itself with its site while open."""

    factory: TrackingSite

    def connectionMade(self) -> None:
        super().connectionMade()
        self.factory._opened(self)

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request line or header line too long: 431, not a silent close."""
        self.refuse(
            b"431 Request Header Fields Too Large",
            "a request line or header is longer than the proxy accepts",
            "request_header_too_large",
        )

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted's answer to a malformed request line or header has no
        # body; ours is the OpenAI error body every other refusal has.
        # (A private hook: the fuzz tests notice if Twisted renames it.)
        self.refuse(b"400 Bad Request", "malformed HTTP request", "malformed_request")

    def refuse(self, status: bytes, message: str, code: str) -> None:
        """Answer an OpenAI error body before any resource ran, and close."""
        body = error_body(message, "invalid_request_error", code)
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body)
            )
        self.loseConnection()

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        try:
            super().connectionLost(reason)
        finally:
            self.factory._closed(self)


class LimitedRequest(Request):
    """A request whose body is refused with 413 as soon as it is too large.

    The check runs on ``Content-Length`` before any byte of the body is
    read, and on the bytes received for a chunked body, so an oversized body
    is never buffered whole.
    """

    _refused = False
    _received = 0

    def _limit(self) -> int:
        return cast(TrackingSite, self.channel.site).max_body_size  # type: ignore[attr-defined]

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self._limit():
            self._refuse()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._received += len(data)
        if self._received > self._limit():
            self._refuse()
            return
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if not self._refused:
            super().requestReceived(command, path, version)

    def connectionLost(self, reason: Any) -> None:
        site = getattr(self.channel, "site", None)
        abandoned = not self.finished and not self._refused and self.method != b"(no method yet)"
        super().connectionLost(reason)
        if abandoned and isinstance(site, TrackingSite) and site.access_log is not None:
            site.access_log.request_ended(self, client_left=True)

    def _refuse(self) -> None:
        self._refused = True
        channel = self.channel
        if isinstance(channel, _TrackedChannel):
            channel.refuse(
                b"413 Payload Too Large",
                f"request body is larger than the proxy's limit of {self._limit()} bytes",
                "request_too_large",
            )


class TrackingSite(Site):
    """A ``Site`` whose open connections can all be closed, and waited for."""

    protocol = _TrackedChannel  # type: ignore[assignment]

    def __init__(
        self,
        resource: IResource,
        max_body_size: int,
        access_log: AccessLog | None = None,
        **kwargs: Any,
    ) -> None:
        # No form parsing: the proxy reads JSON bodies, and Twisted would
        # parse every POST's Content-Type through ``email`` to look for forms.
        super().__init__(
            resource, requestFactory=LimitedRequest, parsePOSTFormSubmission=False, **kwargs
        )
        self.max_body_size = max_body_size
        #: When set, replaces Twisted's access line with one structured event.
        self.access_log = access_log
        self.displayTracebacks = False
        self._open: dict[HTTPChannel, Happened] = {}

    def log(self, request: http.Request) -> None:
        if self.access_log is None:
            super().log(request)
        else:
            self.access_log.request_ended(request)

    def channels(self) -> list[HTTPChannel]:
        """The HTTP channels open now."""
        return list(self._open)

    def connection_lost(self, channel: HTTPChannel) -> Deferred[None]:
        """Fires when an open channel's connection is gone."""
        return self._open[channel].wait()

    def close_connections(self, abort: bool = True) -> Deferred[Any]:
        """Close every open connection; fires when all are gone.

        ``abort=False`` lets each connection send what it has buffered
        first (an answer just finished); ``abort=True`` drops it at once.
        """
        waiting = [self.connection_lost(channel) for channel in self._open]
        for channel in list(self._open):
            if abort:
                channel.transport.abortConnection()  # type: ignore[union-attr]
            else:
                channel.loseConnection()
        return DeferredList(waiting)

    def _opened(self, channel: HTTPChannel) -> None:
        self._open[channel] = Happened()

    def _closed(self, channel: HTTPChannel) -> None:
        lost = self._open.pop(channel, None)
        if lost is not None:
            lost.fire()
