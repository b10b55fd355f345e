"""The listening side: a Twisted Web site that knows its open connections.

Knowing them lets a stopping service close every client connection and wait
until each is gone, so nothing is left half-open after shutdown (and trial
finds a clean reactor after each test). What is refused before the app sees
it is refused here, as JSON: connections past ``--max-connections``, bodies
too large or too many, requests too slow to arrive (``deadlines``), header
lines too long, malformed HTTP (a URL or Host the app cannot route:
``front.FrontDoor``).
"""

from __future__ import annotations

import time
from typing import Any, cast

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from nixl_twisted import __version__
from nixl_twisted.access import AccessLog, record_of
from nixl_twisted.config import ProxyConfig
from nixl_twisted.deadlines import ClientLimits, RequestDeadlines
from nixl_twisted.errors import error_body
from nixl_twisted.events import Happened
from nixl_twisted.metrics import route_label
from nixl_twisted.refusals import Refusals


class _TrackedChannel(HTTPChannel):
    """An HTTP/1.1 channel that registers itself with its site while open.

    It keeps the deadlines of the request it is receiving
    (``nixl_twisted.deadlines``): 408 and closed when a client takes too long.
    """

    factory: TrackingSite
    _deadlines: RequestDeadlines | None = None
    #: Between requests on a kept-alive connection: the idle timeout applies.
    _between_requests = False

    def connectionMade(self) -> None:
        super().connectionMade()
        if not self.factory._opened(self):
            return
        self._deadlines = RequestDeadlines(self.factory.clock)
        self._deadlines.head(self.factory.limits)

    def dataReceived(self, data: bytes) -> None:
        if self._between_requests and data and self._deadlines is not None:
            self._between_requests = False
            self._deadlines.head(self.factory.limits)
        super().dataReceived(data)

    def allHeadersReceived(self) -> None:
        super().allHeadersReceived()
        if self._deadlines is not None and self.length != 0:
            self._deadlines.body(self.factory.limits)

    def allContentReceived(self) -> None:
        if self._deadlines is not None:
            self._deadlines.done()
        super().allContentReceived()

    def requestDone(self, request: http.Request) -> None:
        # Before Twisted replays what the client pipelined (through dataReceived).
        self._between_requests = True
        super().requestDone(request)

    def late(self, now: float) -> bool:
        """Whether the request being received has missed its deadline."""
        if self._deadlines is None or self._deadlines.awaiting is None:
            return False
        request = self.requests[-1] if self.requests else None
        received = request._received if isinstance(request, LimitedRequest) else 0
        return self._deadlines.passed(now, received)

    def timed_out(self) -> None:
        """A deadline passed: 408, and the connection closed."""
        assert self._deadlines is not None and self._deadlines.awaiting is not None
        what = self._deadlines.awaiting
        self._deadlines.done()
        limits = self.factory.limits
        seconds = limits.header_timeout if what == "header" else limits.body_timeout
        code = f"{what}_timeout"
        if self.requests and isinstance(self.requests[-1], LimitedRequest):
            self.requests[-1]._refused = True  # no access event: it never arrived
        self.factory.refused(code, f"a request's {what} took longer than {seconds:g} s")
        self.refuse(
            b"408 Request Timeout",
            f"the request's {what} did not arrive in time ({seconds:g} s"
            + (f", extended by 1 s per {limits.body_min_rate} bytes" if what == "body" and
               limits.body_min_rate else "") + ")",
            code,
        )  # fmt: skip

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
        if self._deadlines is not None:
            self._deadlines.done()
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

    ``Content-Length`` is checked before any byte of the body is read, and
    the bytes received as they arrive, so an oversized body is never
    buffered whole: 413 past ``--max-body-size`` (and the connection
    closed). The bodies all requests hold (``--max-buffered-bodies``) count
    what has arrived, not what was announced, so a slow upload cannot
    reserve bytes it never sends: past the budget, 503 with ``Retry-After``
    at once, the rest of the body read and dropped (so that a client still
    sending it gets the answer rather than a reset connection), or, when
    the client waits for ``100 Continue``, the connection closed. What a
    request holds is given back when it ends.
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
        site: TrackingSite = self.channel.site  # type: ignore[attr-defined]
        return site

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self._site().limits.max_body_size:
            self._refuse_too_large()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return  # dropped: answered already
        self._received += len(data)
        if self._received > self._site().limits.max_body_size:
            self._refuse_too_large()
            return
        if not self._hold(len(data)):
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
                metrics = site.access_log.metrics
                metrics.child(metrics.time_to_first_byte, route).observe(waited)
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
        limit = self._site().limits.max_body_size
        message = f"request body is larger than the proxy's limit of {limit} bytes"
        self._site().refused("request_too_large", message)
        self._refused = True
        self._no_continue()
        channel = self.channel
        if isinstance(channel, _TrackedChannel):
            channel.refuse(b"413 Payload Too Large", message, "request_too_large")

    def _refuse_busy(self) -> None:
        message = "the proxy holds as many request bodies as it may now; try again shortly"
        self._site().refused("request_bodies_buffer_full", message)
        # A client that waits for 100 Continue sends no body to read: close.
        self._refused, self._discarding = True, not self._no_continue()
        channel = self.channel
        if isinstance(channel, _TrackedChannel):
            answer = channel.answer_early if self._discarding else channel.refuse
            answer(b"503 Service Unavailable", message, "request_bodies_buffer_full",
                   "overloaded_error", b"Retry-After: 1\r\n")  # fmt: skip

    def _no_continue(self) -> bool:
        """Refused: no ``100 Continue`` may follow; True if the client was waiting for one.

        Twisted sends it after ``gotLength`` when the request asks for it; a
        request without the header gets none.
        """
        expected = self.requestHeaders.getRawHeaders(b"expect")
        self.requestHeaders.removeHeader(b"expect")
        return bool(expected) and not self._received


class TrackingSite(Site):
    """A ``Site`` whose open connections can all be closed, and waited for."""

    protocol = _TrackedChannel  # type: ignore[assignment]
    #: No "Starting factory <...TrackingSite object at 0x...>" line: "listening on" says it.
    noisy = False

    def __init__(
        self,
        resource: IResource,
        limits: ClientLimits,
        clock: IReactorTime,
        access_log: AccessLog | None = None,
        body_budget: BodyBudget | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        # No form parsing: the proxy reads JSON bodies, and Twisted would
        # parse every POST's Content-Type through ``email`` to look for forms.
        # The clock drives the connections' idle timeouts and deadlines.
        super().__init__(
            resource, requestFactory=LimitedRequest, parsePOSTFormSubmission=False, reactor=clock
        )
        self.clock = clock
        #: Read afresh for each connection and request: a reload replaces it.
        self.limits = limits
        self.body_budget = body_budget
        #: When set, replaces Twisted's access line with one structured event.
        self.access_log = access_log
        self.refusals = refusals
        self.displayTracebacks = False
        self._open: dict[_TrackedChannel, Happened] = {}
        #: Looks at every open connection's deadline once a second (``deadlines``).
        self._sweeping = LoopingCall(self._sweep)
        self._sweeping.clock = clock

    def configure(self, config: ProxyConfig) -> None:
        """A reload: the new limits apply to the next connection and request."""
        self.limits = ClientLimits.of(config)
        if self.body_budget is not None:
            self.body_budget.limit = config.limits.max_buffered_bodies
        if self.access_log is not None:
            self.access_log.emit = config.access_log

    def refused(self, reason: str, message: str) -> None:
        """Count (and maybe log) a refusal made before the app saw the request."""
        if self.refusals is not None:
            self.refusals.refused(reason, message)

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
        return self._open[cast(_TrackedChannel, channel)].wait()

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

    def _sweep(self) -> None:
        now = self.clock.seconds()
        for channel in [c for c in self._open if c.late(now)]:
            channel.timed_out()

    def _opened(self, channel: _TrackedChannel) -> bool:
        """Track a new connection, or refuse it past ``--max-connections`` (False)."""
        limit = self.limits.max_connections
        self._open[channel] = Happened()
        if not self._sweeping.running:
            self._sweeping.start(1.0, now=False)
        if len(self._open) <= limit:
            return True
        message = f"the proxy has as many client connections open as it may ({limit}); retry"
        self.refused("too_many_connections", message)
        channel.refuse(b"503 Service Unavailable", message, "too_many_connections",
                       "overloaded_error", b"Retry-After: 1\r\n")  # fmt: skip
        return False

    def _closed(self, channel: _TrackedChannel) -> None:
        lost = self._open.pop(channel, None)
        if lost is not None:
            lost.fire()
        if not self._open and self._sweeping.running:
            self._sweeping.stop()  # nothing to look at: no timer left behind
