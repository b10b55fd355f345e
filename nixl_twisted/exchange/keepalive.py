"""SSE comment frames while a streamed completion waits for its first token (``--sse-keepalive``).

Load balancers and clients cut a connection idle past their own timeout
(often 60 s); a stream queued for its slots, or whose long prompt is being
prefilled, can be idle that long before its first token. A comment frame
(``: keep-alive``) is skipped by every SSE parser. The first one sends the
response headers (200, ``text/event-stream``): from then on a failure can no
longer be a status, and ends the stream as an in-band error event
(``protocol.errors.late_error_event``, ``docs/failures.md``).
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.web import server
from twisted.web.iweb import IResponse

from nixl_twisted.backends.upstream import read_body
from nixl_twisted.exchange.request import ExchangeRequest, connected
from nixl_twisted.protocol.errors import late_answer_event

#: The frame: an SSE comment, which no client takes for an event.
FRAME = b": keep-alive\n\n"


class KeepAlive:
    """Writes ``FRAME`` to one client every ``interval`` seconds until stopped."""

    def __init__(self, request: server.Request, clock: IReactorTime, interval: float) -> None:
        self._request = request
        self._clock = clock
        self._interval = interval
        #: Frames written so far.
        self.frames = 0
        self._timer: IDelayedCall | None = clock.callLater(interval, self._beat)

    @property
    def opened(self) -> bool:
        """The proxy sent the response headers itself: a failure is now in-band."""
        return self.frames > 0

    def _beat(self) -> None:
        self._timer = None
        request = self._request
        if request.channel is None or request.finished:
            return  # (its client left: nobody to keep)
        if not request.startedWriting:
            request.setResponseCode(200)
            request.setHeader(b"Content-Type", b"text/event-stream")
            request.setHeader(b"Cache-Control", b"no-cache")
        # Twisted's own write, past the proxy's request class: a comment is no
        # answer, and must not stop the client's time-to-first-byte clock.
        server.Request.write(request, FRAME)
        self.frames += 1
        self._timer = self._clock.callLater(self._interval, self._beat)

    def stop(self) -> None:
        """No more frames (the first token came, decode answered otherwise, or it ended)."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def in_band(self, response: IResponse) -> bool:
        """Decode's headers are in: frames go on until its first byte only in a 200 event
        stream (anything else is relayed as decode sent it, and must take no comment).
        True: the client had its 200 already, and decode's error answer goes in-band."""
        content_type = response.headers.getRawHeaders(b"content-type", [b""])[0]
        if response.code == 200 and content_type.startswith(b"text/event-stream"):
            return False
        self.stop()
        return self.opened and response.code != 200

    def answer_in_band(self, response: IResponse, timeout: float) -> Deferred[None]:
        """Decode's error answer, read whole (within ``timeout``), as the event that ends
        the stream; the access event says decode's status."""
        request = self._request

        def write(body: bytes) -> None:
            request.setResponseCode(response.code)
            request.write(late_answer_event(request.path, response.code, body))

        return read_body(response).addTimeout(timeout, self._clock).addCallback(write)


def keep_alive(
    request: ExchangeRequest, clock: IReactorTime, interval: float, streamed: bool
) -> KeepAlive | None:
    """A keep-alive for a streamed completion's own client, or None: off (``interval`` 0),
    not streamed, or a batch's part (the batch writes to the client)."""
    client = connected(request)
    if not interval or not streamed or not isinstance(client, server.Request):
        return None
    return KeepAlive(client, clock, interval)
