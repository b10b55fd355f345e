"""Backend bodies relayed to the client as they stream.

The relay registers the backend socket as a push producer on the client's
request, so a client that reads slowly pauses the backend instead of growing
the proxy's memory. ``break_off`` ends a response whose backend broke off so
that the client can tell it is incomplete. What they write to is an
``ExchangeRequest``: the client's own request, or one prompt of a batch.

A relay is composed of small parts (``relay_parts``), as treq composes a
body reader from a protocol and a finished Deferred: its ``Silence`` (the
idle timer), its ``Passes`` (what stands between the body and the client,
and may change it) and what has ``Seen`` it (what looks at it and never
changes it).
"""

from __future__ import annotations

import contextlib
from typing import cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, ITCPTransport
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import UNKNOWN_LENGTH, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IRequest, IResponse
from zope.interface import implementer

from nixl_twisted.exchange.relay_parts import NO_PASSES, NO_SEEN, Passes, Seen, Silence
from nixl_twisted.exchange.request import ExchangeRequest, connected
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.decode_handle import HANDLE_NAME
from nixl_twisted.protocol.errors import stream_error_event
from nixl_twisted.protocol.headers import client_response_headers

_DONE = Failure(ResponseDone())


class StreamSilent(Exception):
    """A backend body went silent for longer than the idle timeout."""


class ClientSlow(Exception):
    """The client read nothing for the idle timeout: it held the backend's body paused."""


class StreamCutShort(Exception):
    """An event stream ended without its route's last event (``[DONE]``, ``message_stop``,
    ``response.completed``): the backend's connection closed, or its body ended, mid-answer."""


@implementer(IPushProducer)
class _Paced:
    """The backend's socket as the client's producer: the client's connection pausing it is
    told to the relay, whose silence is then the client's, not the backend's."""

    def __init__(self, transport: IPushProducer, relay: _BodyRelay) -> None:
        self.transport = transport
        self.relay = relay

    def pauseProducing(self) -> None:
        self.relay.paused()
        self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        self.relay.resumed()
        self.transport.resumeProducing()

    def stopProducing(self) -> None:
        self.transport.stopProducing()


#: Each route's last events, as the relay looks for them: at a line's start.
_AT_LINE_START: dict[tuple[bytes, ...], tuple[bytes, ...]] = {}


def _at_line_start(terminal: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """``terminal``'s events as the relay looks for them, made once a route."""
    ends = _AT_LINE_START[terminal] = tuple(b"\n" + event for event in terminal)
    return ends


class _BodyRelay(Protocol):
    """Writes each chunk of a backend body to the client as it arrives.

    A timer ends the relay when the backend goes silent: a long generation
    is never cut, a stalled one is. Each chunk only notes when it came
    (restarting the timer on every chunk cost three Python calls a token);
    a timer that fires while data came since is armed again for what is
    left of the silence, so a stall is still caught to the instant. While
    the client's connection has paused the backend (its buffer full: it
    stopped reading), silence is the client's: the backend's is counted
    again from when the client resumes it, and a client that reads nothing
    for the whole timeout ends the relay as ``ClientSlow``.
    """

    def __init__(
        self,
        request: ExchangeRequest,
        finished: Deferred[None],
        silence: Silence,
        passes: Passes = NO_PASSES,
        seen: Seen = NO_SEEN,
    ) -> None:
        # (the parts' fields copied: every chunk reads them)
        self._taken = passes.taken
        self._hidden = passes.hidden
        self._filtered = passes.filtered
        self._on_first_byte = seen.first_byte
        self._watch = seen.watch
        self._on_end = seen.tail
        self._before_last = self._last = b""
        self._request = request
        self._finished = finished
        self._clock = silence.clock
        self._idle_timeout = silence.seconds
        self._timer: IDelayedCall | None = None
        #: When the last chunk came (the clock's seconds).
        self._heard = 0.0
        #: Since when the client's connection has held the backend paused (None: it has not).
        self._paused_at: float | None = None
        #: What the client's request was given as its producer.
        self._producer: _Paced | None = None
        #: An event stream's last events, each at a line's start (empty: not looked for, or
        #: seen), and the end of the chunk before (where one may begin).
        terminal = seen.terminal
        if terminal:
            terminal = _AT_LINE_START.get(terminal) or _at_line_start(terminal)
        self._terminal = terminal
        self._edge = b"\n"

    def connectionMade(self) -> None:
        client = connected(self._request)
        if client is not None:
            self._producer = _Paced(cast(IPushProducer, self.transport), self)
            client.registerProducer(self._producer, True)
        if self._idle_timeout is not None:
            self._heard = self._clock.seconds()
            self._timer = self._clock.callLater(self._idle_timeout, self._silent)

    def dataReceived(self, data: bytes) -> None:
        if self._finished.called:
            return  # (stopped: what its connection still delivers is nobody's)
        if self._on_first_byte is not None:
            first, self._on_first_byte = self._on_first_byte, None
            first()
        if self._watch is not None and self._watch(data):
            self._watch = None
        if self._timer is not None:
            self._heard = self._clock.seconds()
        if self._terminal:
            self._look_for_end(data)
        taken = self._taken
        # (inlined: a whole event that does not name decode's handle passes without a call)
        if taken is not None and not (
            taken.idle and data[-2:] == b"\n\n" and HANDLE_NAME not in data
        ):
            data = taken(data)
            if not data:
                return
        filtered = self._filtered
        if filtered is not None:
            data = filtered(data)
            if filtered.done:
                self._filtered = None
            if not data:
                return
        # (``_pass``, inlined: a call per token on every stream)
        self._before_last, self._last = self._last, data
        if self._hidden is not None:
            data = self._hidden(data)
            if not data:
                return
        self._request.write(data)

    def _pass(self, data: bytes) -> None:
        """``data`` to the client, as decode sent it or as the filter let it through."""
        self._before_last, self._last = self._last, data
        if self._hidden is not None:
            data = self._hidden(data)
            if not data:
                return
        self._request.write(data)

    def _look_for_end(self, data: bytes) -> None:
        """Whether the route's last event begins in ``data`` (or across the chunk before)."""
        seen = self._edge + data
        if any(end in seen for end in self._terminal):
            self._terminal = ()
        else:
            self._edge = seen[-32:]

    def paused(self) -> None:
        """The client's connection paused the backend: its silence is the client's now."""
        if self._paused_at is None:
            self._paused_at = self._clock.seconds()

    def resumed(self) -> None:
        """The client read again: the backend's silence is counted from now."""
        self._paused_at = None
        self._heard = self._clock.seconds()

    def _silent(self) -> None:
        assert self._idle_timeout is not None
        now = self._clock.seconds()
        since = self._heard if self._paused_at is None else self._paused_at
        left = since + self._idle_timeout - now
        if left > 0:  # data came (or the client paused) since: wait out the rest
            self._timer = self._clock.callLater(left, self._silent)
            return
        self._timer = None
        self.stop()
        if self._finished.called:
            return
        if self._paused_at is not None:
            self._finished.errback(
                ClientSlow(f"the client read nothing for {self._idle_timeout:g} s")
            )
        else:
            self._finished.errback(
                StreamSilent(f"no data from the backend for {self._idle_timeout:g} s")
            )

    def stop(self) -> None:
        """Close the backend connection (vLLM then aborts the request); from now on the
        client may take another producer (a moved answer's next decode)."""
        self._unregister()
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()

    def _unregister(self) -> None:
        client = connected(self._request)
        if client is not None and client.producer is self._producer is not None:
            client.unregisterProducer()

    def connectionLost(self, reason: Failure = _DONE) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._unregister()
        ended = reason.check(ResponseDone, PotentialDataLoss) is not None
        if ended and self._terminal:  # (an event stream short of its last event)
            how = "closed its connection" if reason.check(PotentialDataLoss) else "ended its body"
            ended, reason = False, Failure(StreamCutShort(f"the backend {how} mid-stream"))
        if ended and self._taken is not None and not self._finished.called:
            taken = self._taken.rest()  # (only a body that ended whole lets it go)
            filtered = self._filtered
            if taken and filtered is not None:
                taken = filtered(taken)
            if taken:
                self._pass(taken)
        if ended and self._filtered is not None and not self._finished.called:
            held = self._filtered.rest()  # (only a body that ended whole lets it go)
            if held:
                self._pass(held)
        if self._on_end is not None:
            self._on_end(self._before_last + self._last)
        rest = self._hidden.rest() if self._hidden is not None else b""
        if rest and not self._finished.called:
            self._request.write(rest)
        if self._finished.called:
            return
        if ended:
            self._finished.callback(None)
        else:
            self._finished.errback(reason)


def start_response(request: IRequest | ExchangeRequest, response: IResponse) -> None:
    """Give the client the backend's status and end-to-end headers.

    ``Content-Length`` comes from what the body will really be: a length the
    backend announced but a decoder changed is never passed on.
    """
    request.setResponseCode(response.code)
    for name, values in client_response_headers(response.headers).getAllRawHeaders():
        if name.lower() != b"content-length":
            request.responseHeaders.setRawHeaders(name, list(values))
    if response.length is not UNKNOWN_LENGTH:
        request.responseHeaders.setRawHeaders(
            b"Content-Length", [str(response.length).encode("ascii")]
        )


def relay(
    request: ExchangeRequest,
    response: IResponse,
    silence: Silence,
    passes: Passes = NO_PASSES,
    seen: Seen = NO_SEEN,
) -> Deferred[None]:
    """Relay a backend body to the client; fires when the backend's body ended.

    What ``seen`` looks at is the body as the client gets it, after
    ``passes.filtered`` and before ``passes.hidden`` takes its chunk out.
    Fails with ``StreamSilent`` after ``silence.seconds`` without data,
    ``ClientSlow`` after as long with the client reading nothing.
    Cancelling the Deferred closes the backend connection, which makes vLLM
    abort the request and free its KV blocks.
    """
    finished: Deferred[None] = Deferred(lambda _: relaying.stop())
    relaying = _BodyRelay(request, finished, silence, passes, seen)
    response.deliverBody(relaying)
    return finished


class _Discard(Protocol):
    def connectionMade(self) -> None:
        cast(IPushProducer, self.transport).stopProducing()


def abandon(response: IResponse) -> None:
    """Close a backend response nobody will read (its client has left)."""
    response.deliverBody(_Discard())


async def break_off(request: ExchangeRequest, message: str, code: ErrorCode) -> None:
    """End a response whose backend body broke off, so the client can tell.

    An event stream gets an in-band error event first. Then the connection
    is closed without the final chunk (or short of the announced length),
    and Klein must not finish the request as if it were complete.
    """
    client = connected(request)
    if client is None:
        return
    content_type = client.responseHeaders.getRawHeaders(b"content-type", [b""])[0]
    if content_type.startswith(b"text/event-stream"):
        client.write(stream_error_event(client.path, message, code))
    lost = client.notifyFinish()
    client.channel.loseConnection()
    with contextlib.suppress(Exception):
        await lost


async def close_slow(request: ExchangeRequest) -> None:
    """Close the connection of a client that stopped reading (``ClientSlow``): at once,
    since what is buffered for it would never be read."""
    client = connected(request)
    if client is None:
        return
    lost = client.notifyFinish()
    cast(ITCPTransport, client.channel.transport).abortConnection()
    with contextlib.suppress(Exception):
        await lost
