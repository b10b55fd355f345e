"""The listening side: a Twisted Web site that knows its open connections.

Knowing them lets a stopping service close every client connection and wait
until each is gone, so nothing is left half-open after shutdown (and trial
finds a clean reactor after each test). What is refused before the app sees
it is refused here, as JSON: connections past ``--max-connections``,
requests too slow to arrive (``deadlines``), header lines too long or
too many (431), malformed HTTP and framing a backend could read otherwise
(``framing``); bodies too large or too many by its requests (``intake``);
a URL or Host the app cannot route by ``front.FrontDoor``.
"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.http import HTTPChannel, _ChunkedTransferDecoder
from twisted.web.resource import IResource
from twisted.web.server import Site

from nixl_twisted.config import ProxyConfig
from nixl_twisted.happened import Happened
from nixl_twisted.observe.access import AccessLog
from nixl_twisted.observe.refusals import Refusals
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError, for_route
from nixl_twisted.protocol.headers import IDENTITY, conflicting, said_twice
from nixl_twisted.web.deadlines import ClientLimits, RequestDeadlines
from nixl_twisted.web.framing import BoundedChunks, header_problem
from nixl_twisted.web.intake import BodyBudget, LimitedRequest
from nixl_twisted.web.keys import ClientKeys, needs_key

#: The status lines of the answers written before any resource ran.
_STATUS_LINES = {
    400: b"400 Bad Request",
    401: b"401 Unauthorized",
    408: b"408 Request Timeout",
    413: b"413 Payload Too Large",
    431: b"431 Request Header Fields Too Large",
    503: b"503 Service Unavailable",
}
#: A deadline that passed (``RequestDeadlines.awaiting``), as the client is told it.
_TIMEOUTS = {"header": ErrorCode.HEADER_TIMEOUT, "body": ErrorCode.BODY_TIMEOUT}


class _TrackedChannel(HTTPChannel):
    """An HTTP/1.1 channel that registers itself with its site while open.

    It keeps the deadlines of the request it is receiving
    (``nixl_twisted.web.deadlines``): 408 and closed when a client takes too long.
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
        if self._unkeyed():
            return  # answered 401: the body, if any, is read and dropped (or closed)
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

    def checkPersistence(self, request: http.Request, version: bytes) -> bool:
        if not self.factory.handing_over:
            return bool(super().checkPersistence(request, version))
        request.responseHeaders.setRawHeaders(b"connection", [b"close"])
        return False

    def hand_over(self) -> None:
        """The proxy stops: an idle kept-alive connection is closed now, any other once its
        answers end, each answer not yet begun saying ``Connection: close``."""
        if not self.requests:
            if self._between_requests:
                self.loseConnection()
            return  # (a first request on its way: ``checkPersistence`` closes after it)
        self.persistent = False
        for request in self.requests:
            if not request.startedWriting:
                request.responseHeaders.setRawHeaders(b"connection", [b"close"])

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
        request = self.requests[-1] if self.requests else None
        if isinstance(request, LimitedRequest) and request._discarding:
            self.loseConnection()  # a refused body, dropped: its answer was written already
            return
        code = _TIMEOUTS[what]
        if self.requests and isinstance(self.requests[-1], LimitedRequest):
            self.requests[-1]._refused = True  # no access event: it never arrived
        logged, said = _lateness(what, self._deadlines.stalled, self.factory.limits)
        self.factory.refused(code, logged)
        self.refuse(code, said)

    def lineReceived(self, line: bytes) -> None:
        # (Twisted's own count of the head's bytes, which it answers with a bare 400.)
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._too_large("the request's line and headers are larger than the proxy accepts")
            return
        super().lineReceived(line)

    def headerReceived(self, line: bytes) -> bool:
        if self._receivedHeaderCount >= self.maxHeaders:
            self._too_large(f"the request has more than {self.maxHeaders} headers")
            return False
        problem = header_problem(line, framed=self._transferDecoder is not None)
        if problem is not None:
            self.refuse(ErrorCode.MALFORMED_REQUEST, problem)
            return False
        if not super().headerReceived(line):
            return False
        if type(self._transferDecoder) is _ChunkedTransferDecoder:
            request = self.requests[-1]
            assert isinstance(request, LimitedRequest)  # (the site's request factory)
            self._transferDecoder = BoundedChunks(
                request.handleContentChunk,
                self._finishRequestBody,
                lambda said: self.refuse(ErrorCode.MALFORMED_REQUEST, said),
                request.chunk_announced,
            )
        return True

    def _too_large(self, message: str) -> None:
        self.refuse(ErrorCode.REQUEST_HEADER_TOO_LARGE, message)

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request line or header line too long: 431, not a silent close."""
        self._too_large("a request line or header is longer than the proxy accepts")

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted's answer to a malformed request line or header has no
        # body; ours is the OpenAI error body every other refusal has.
        # (A private hook: the fuzz tests notice if Twisted renames it.)
        self.refuse(ErrorCode.MALFORMED_REQUEST, "malformed HTTP request")

    def _unkeyed(self) -> bool:
        """A client route without a key the proxy knows: 401 now, before any body is read
        (400 for two different keys: ``headers.conflicting``).

        The body is then read and dropped (``LimitedRequest.refuse_unread``),
        under the body's deadline, so that a client sending it reads the 401.
        """
        keys = self.factory.client_keys
        request = self.requests[-1] if self.requests else None
        path = getattr(self, "_path", b"")  # (Twisted's request line, read so far)
        if keys is None or not keys.required or request is None or not needs_key(path):
            return False
        twice = conflicting(request.requestHeaders, IDENTITY)
        if twice is None and keys.tenant(request.requestHeaders, path) is not None:
            return False
        assert isinstance(request, LimitedRequest)  # (the site's request factory)
        code, challenge = ErrorCode.INVALID_API_KEY, b"WWW-Authenticate: Bearer\r\n"
        message = "a valid API key is required (Authorization: Bearer KEY)"
        if twice is not None:
            code, challenge, message = ErrorCode.CONFLICTING_HEADERS, b"", said_twice(twice)
        # (Refused: no access event, it was never served.)
        reading = request.refuse_unread(code, message, challenge, path, self.length)
        if reading and self.length != 0 and self._deadlines is not None:
            self._deadlines.body(self.factory.limits)
        return True

    def refuse(
        self, code: ErrorCode, message: str, headers: bytes = b"", path: bytes = b""
    ) -> None:
        """Answer an error body (in ``path``'s route's shape) before any resource ran, and close."""
        self.answer_early(code, message, headers, path)
        self.loseConnection()

    def answer_early(
        self, code: ErrorCode, message: str, headers: bytes = b"", path: bytes = b""
    ) -> None:
        """Write an error answer (``Connection: close``) before any resource ran.

        OpenAI's shape, or Anthropic's for a Messages route's ``path``.
        """
        assert code.status is not None
        body = for_route(path, ProxyError(code, message))
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n%s"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (_STATUS_LINES[code.status], headers, len(body), body)
            )

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        if self._deadlines is not None:
            self._deadlines.done()
        try:
            super().connectionLost(reason)
        finally:
            self.factory._closed(self)


def _lateness(what: str, stalled: bool, limits: ClientLimits) -> tuple[str, str]:
    """Why a request missed its deadline: as logged, and as its client is told."""
    rate = limits.body_min_rate
    if stalled:
        window = f"fewer than {rate} bytes of body in {limits.body_timeout:g} s"
        return f"a request's body stalled: {window}", f"the request's body stalled: {window}"
    seconds = limits.header_timeout if what == "header" else limits.body_timeout
    rule = f"{seconds:g} s"
    if what == "body" and rate:
        rule += f", extended by 1 s per {rate} bytes, {limits.body_max_timeout:g} s at most"
    return (
        f"a request's {what} took longer than {seconds:g} s",
        f"the request's {what} did not arrive in time ({rule})",
    )


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
        client_keys: ClientKeys | None = None,
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
        #: The keys clients must send (``--api-key``), on the client endpoints only.
        self.client_keys = client_keys
        self.refusals = refusals
        self.displayTracebacks = False
        self._open: dict[_TrackedChannel, Happened] = {}
        #: Stopping: every answer closes its connection (``hand_over``).
        self.handing_over = False
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

    def refused(self, reason: ErrorCode, message: str) -> None:
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

    def hand_over(self) -> None:
        """From now on every answer says ``Connection: close`` and closes its connection, and
        idle kept-alive connections close now: clients reconnect through their balancer."""
        self.handing_over = True
        for channel in list(self._open):
            channel.hand_over()

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
        self.refused(ErrorCode.TOO_MANY_CONNECTIONS, message)
        channel.refuse(ErrorCode.TOO_MANY_CONNECTIONS, message, b"Retry-After: 1\r\n")
        return False

    def _closed(self, channel: _TrackedChannel) -> None:
        lost = self._open.pop(channel, None)
        if lost is not None:
            lost.fire()
        if not self._open and self._sweeping.running:
            self._sweeping.stop()  # nothing to look at: no timer left behind
