"""The listening side: a Twisted Web site that knows its open connections.

Knowing them lets a stopping service close every client connection and wait
until each is gone, so nothing is left half-open after shutdown (and trial
finds a clean reactor after each test). What is refused before the app sees
it is refused here, as JSON: bodies too large or too many, header lines too
long, malformed HTTP, a URL that is not UTF-8 (``UTF8Only``).
"""

from __future__ import annotations

import time
from typing import Any, cast
from urllib.parse import unquote_to_bytes

from twisted.internet.defer import Deferred, DeferredList
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.http import HTTPChannel
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site

from nixl_twisted import __version__
from nixl_twisted.access import AccessLog, record_of
from nixl_twisted.errors import error_body, json_answer
from nixl_twisted.events import Happened
from nixl_twisted.metrics import route_label


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

    def refuse(
        self,
        status: bytes,
        message: str,
        code: str,
        kind: str = "invalid_request_error",
        headers: bytes = b"",
    ) -> None:
        """Answer an OpenAI error body before any resource ran, and close."""
        self.answer_early(status, message, code, kind, headers)
        self.loseConnection()

    def answer_early(
        self, status: bytes, message: str, code: str, kind: str, headers: bytes = b""
    ) -> None:
        """Write an OpenAI error answer (``Connection: close``) before any resource ran."""
        body = error_body(message, kind, code)
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n%s"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (status, headers, len(body), body)
            )

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        try:
            super().connectionLost(reason)
        finally:
            self.factory._closed(self)


#: The ``Server`` header of every answer.
SERVER = f"nixl-twisted/{__version__}".encode("ascii")


class BodyBudget:
    """The bytes of request bodies all requests may hold at once (``--max-buffered-bodies``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class LimitedRequest(Request):
    """A request whose body is refused as soon as it is too large, or too many are held.

    The checks run on ``Content-Length`` before any byte of the body is
    read, and on the bytes received for a chunked body, so an oversized body
    is never buffered whole: 413 past ``--max-body-size`` (and the
    connection closed), 503 with ``Retry-After`` while the bodies held at
    once would pass ``--max-buffered-bodies``: answered at once, the body
    then read and dropped, so that a client still sending it gets the answer
    rather than a reset connection. What a request holds is given back when
    it ends.
    """

    _refused = False
    _discarding = False
    #: When the request arrived, until its first byte is written.
    _arrived: float | None = None
    _received = 0
    _held = 0

    def setHeader(self, name: bytes | str, value: bytes | str) -> None:
        # Twisted's Request.process sets "Server: TwistedWeb/x.y" on every answer.
        if (name.lower() if isinstance(name, bytes) else name.lower().encode()) == b"server":
            value = SERVER
        super().setHeader(name, value)

    def _site(self) -> TrackingSite:
        return cast(TrackingSite, self.channel.site)  # type: ignore[attr-defined]

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self._site().max_body_size:
            self._refuse_too_large()
            return
        if length and not self._hold(length):
            self._refuse_busy()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return  # dropped: answered already
        self._received += len(data)
        if self._received > self._site().max_body_size:
            self._refuse_too_large()
            return
        if self._received > self._held and not self._hold(self._received - self._held):
            self._refuse_busy()
            return
        super().handleContentChunk(data)

    def _hold(self, size: int) -> bool:
        budget = self._site().body_budget
        if budget is None:
            return True
        if not budget.take(size):
            return False
        if not self._held:
            # (Once the request ends it has no channel, so no site: keep the budget.)
            self.notifyFinish().addBoth(lambda _: budget.give(self._held))
        self._held += size
        return True

    def write(self, data: bytes) -> None:
        if data and self._arrived is not None:
            arrived, self._arrived = self._arrived, None
            site = self._site()
            if site.access_log is not None:
                waited = time.monotonic() - arrived
                record_of(self).time_to_first_byte_seconds = waited
                route = route_label(self.path)
                site.access_log.metrics.time_to_first_byte.labels(route).observe(waited)
        super().write(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        self._arrived = record_of(self).started = time.monotonic()
        if self._discarding:
            self.channel.loseConnection()  # the body is read (and dropped): now close
        elif not self._refused:
            super().requestReceived(command, path, version)

    def connectionLost(self, reason: Any) -> None:
        site = getattr(self.channel, "site", None)
        abandoned = not self.finished and not self._refused and self.method != b"(no method yet)"
        super().connectionLost(reason)
        if abandoned and isinstance(site, TrackingSite) and site.access_log is not None:
            site.access_log.request_ended(self, client_left=True)

    def _refuse_too_large(self) -> None:
        limit = self._site().max_body_size
        self._refuse(b"413 Payload Too Large", "too_large",
                     f"request body is larger than the proxy's limit of {limit} bytes",
                     "request_too_large", "invalid_request_error")  # fmt: skip

    def _refuse_busy(self) -> None:
        self._count_refusal("buffer_full")
        self._refused = self._discarding = True
        channel = self.channel
        if isinstance(channel, _TrackedChannel):
            channel.answer_early(
                b"503 Service Unavailable",
                "the proxy holds as many request bodies as it may now; try again shortly",
                "request_bodies_buffer_full",
                "overloaded_error",
                b"Retry-After: 1\r\n",
            )

    def _refuse(self, status: bytes, reason: str, message: str, code: str, kind: str) -> None:
        self._count_refusal(reason)
        self._refused = True
        channel = self.channel
        if isinstance(channel, _TrackedChannel):
            channel.refuse(status, message, code, kind)

    def _count_refusal(self, reason: str) -> None:
        site = self._site()
        if site.access_log is not None:
            site.access_log.metrics.bodies_refused.labels(reason).inc()


class TrackingSite(Site):
    """A ``Site`` whose open connections can all be closed, and waited for."""

    protocol = _TrackedChannel  # type: ignore[assignment]
    #: No "Starting factory <...TrackingSite object at 0x...>" line: "listening on" says it.
    noisy = False

    def __init__(
        self,
        resource: IResource,
        max_body_size: int,
        access_log: AccessLog | None = None,
        body_budget: BodyBudget | None = None,
        **kwargs: Any,
    ) -> None:
        # No form parsing: the proxy reads JSON bodies, and Twisted would
        # parse every POST's Content-Type through ``email`` to look for forms.
        super().__init__(
            resource, requestFactory=LimitedRequest, parsePOSTFormSubmission=False, **kwargs
        )
        self.max_body_size = max_body_size
        self.body_budget = body_budget
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


class UTF8Only(Resource):
    """Refuses a URL that is not UTF-8 with a JSON 400 before Klein sees it.

    Klein would answer a plain-text 400 and log a traceback for every such
    request: client garbage is not the operator's error.
    """

    isLeaf = True

    def __init__(self, app: IResource) -> None:
        super().__init__()
        self._app = app

    def render(self, request: IRequest) -> bytes | int:
        try:
            unquote_to_bytes(request.path).decode("utf-8")
        except UnicodeDecodeError:
            body = error_body(
                "the request URL is not valid UTF-8", "invalid_request_error", "invalid_url"
            )
            return json_answer(request, 400, body)
        return self._app.render(request)
