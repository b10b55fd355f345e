"""Calls to vLLM instances: one pooled treq client, and relaying a body as it streams.

The relay registers the backend socket as a push producer on the client's
request, so a client that reads slowly pauses the backend instead of growing
the proxy's memory.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, cast

from hyperlink import EncodedURL
from treq.client import HTTPClient
from treq.cookies import IndexableCookieJar
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IConsumer,
    IDelayedCall,
    IPushProducer,
    IReactorTCP,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import (
    UNKNOWN_LENGTH,
    URI,
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    ResponseDone,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import (
    IAgentEndpointFactory,
    IBodyProducer,
    IPolicyForHTTPS,
    IRequest,
    IResponse,
)
from twisted.web.server import Request
from zope.interface import implementer

from nixl_twisted.headers import client_response_headers

#: vLLM (uvicorn) closes idle keep-alive connections after 5 s; a pooled
#: connection kept as long races with that close and fails a POST.
DEFAULT_IDLE_TIMEOUT = 4.0
#: Idle connections kept per instance. Twisted's default of 2 would make
#: every burst above 2 concurrent legs open (and soon close) new sockets.
DEFAULT_MAX_IDLE_PER_INSTANCE = 512
DEFAULT_CONNECT_TIMEOUT = 10.0


def _as_cancelled(failure: Failure) -> Failure:
    """Twisted reports a cancelled request as one that failed *because* it was
    cancelled; say plainly that it was cancelled, so that callers (and
    ``Deferred.addTimeout``) can tell it from a backend that failed."""
    reasons = getattr(failure.value, "reasons", None) or []
    if any(isinstance(r, Failure) and r.check(CancelledError) for r in reasons):
        return Failure(CancelledError())
    return failure


class _NoCookies(IndexableCookieJar):
    """A proxy serves many clients: no backend cookie may leak between them.

    treq wraps every request in a ``CookieAgent``; a jar that neither adds
    nor stores a cookie also spares the per-request ``http.cookiejar`` work.
    """

    def add_cookie_header(self, request: Any) -> None:
        return None

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None


class _ReadyURL(EncodedURL):
    """A backend URL already in URI form, rendered once.

    treq turns every URL it is given into a URI (``to_uri()``, which
    IDNA-encodes the host) and back into text on each call; for the few
    URLs a proxy calls over and over, that is done once here.
    """

    #: Set by ``backend_url`` only; a URL derived from this one (``replace``)
    #: has none and behaves as any ``EncodedURL``.
    _text: str | None = None

    def to_uri(self) -> EncodedURL:
        return self if self._text is not None else super().to_uri()

    def to_text(self, with_password: bool = False) -> str:
        if self._text is not None and not with_password:
            return self._text
        return str(super().to_text(with_password))


@lru_cache(maxsize=1024)
def backend_url(text: str) -> EncodedURL:
    """``text`` as the URI treq would send (cached: one per instance and route)."""
    parsed = EncodedURL.from_text(text)
    if ":" in parsed.host:
        # An IPv6 literal: hyperlink would IDNA-encode it and fail
        # (python-hyper/hyperlink#68); there is nothing in it to encode.
        placeholder = parsed.replace(host="ipv6-literal.invalid").to_uri()
        uri = placeholder.replace(host=parsed.host).to_text()
    else:
        uri = parsed.to_uri().to_text()
    ready = cast(_ReadyURL, _ReadyURL.from_text(uri))
    ready._text = uri
    return ready


@implementer(IBodyProducer)
class _Body:
    """A request body already in memory, written in one go.

    treq's default wraps bytes in a ``FileBodyProducer``, which copies them
    out of a ``BytesIO`` through a cooperator task on a later reactor turn.
    """

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._data)
        return succeed(None)

    def pauseProducing(self) -> None:
        return None

    def resumeProducing(self) -> None:
        return None

    def stopProducing(self) -> None:
        return None


@implementer(IAgentEndpointFactory)
class _Endpoints:
    """One endpoint per backend, made once.

    ``Agent`` would build a ``HostnameEndpoint`` (IDNA-encoding the host)
    for every request, only for the pool to reuse an open connection.
    """

    def __init__(self, reactor: IReactorTCP, connect_timeout: float, tls: IPolicyForHTTPS) -> None:
        self._reactor = reactor
        self._connect_timeout = connect_timeout
        self._tls = tls
        self._made: dict[tuple[bytes, bytes, int], IStreamClientEndpoint] = {}

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._made.get(key)
        if endpoint is None:
            endpoint = HostnameEndpoint(
                self._reactor, uri.host, uri.port, timeout=self._connect_timeout
            )
            if uri.scheme == b"https":
                creator = self._tls.creatorForNetloc(uri.host, uri.port)
                endpoint = wrapClientTLS(creator, endpoint)
            self._made[key] = endpoint
        return endpoint


class Upstream:
    """The proxy's HTTP client for every backend call, over one connection pool."""

    def __init__(
        self,
        reactor: IReactorTCP | None = None,
        *,
        max_idle_per_instance: int = DEFAULT_MAX_IDLE_PER_INSTANCE,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        tls: IPolicyForHTTPS | None = None,
    ) -> None:
        """``tls`` decides which certificates an ``https`` backend may show
        (by default, the system's trusted roots, as a browser would)."""
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = max_idle_per_instance
        self._pool.cachedConnectionTimeout = idle_timeout  # type: ignore[assignment]
        agent = Agent.usingEndpointFactory(
            reactor,
            _Endpoints(reactor, connect_timeout, tls or BrowserLikePolicyForHTTPS()),
            pool=self._pool,
        )
        self._http = HTTPClient(agent, cookiejar=_NoCookies(), data_to_body_producer=_Body)

    def post(self, url: str, body: bytes, headers: Headers) -> Deferred[IResponse]:
        """POST a JSON body; the response's body is left unread for the caller.

        Cancelling closes the connection and fails with ``CancelledError``.
        """
        sent = self._http.request(
            "POST",
            backend_url(url),
            data=body,
            headers=headers,
            allow_redirects=False,
            unbuffered=True,
        )
        return sent.addErrback(_as_cancelled)  # type: ignore[return-value]

    def get(self, url: str, headers: Headers) -> Deferred[IResponse]:
        """GET a resource; the response's body is left unread for the caller."""
        sent = self._http.request(
            "GET", backend_url(url), headers=headers, allow_redirects=False, unbuffered=True
        )
        return sent.addErrback(_as_cancelled)  # type: ignore[return-value]

    def close(self) -> Deferred[None]:
        """Close every idle pooled connection (on service stop)."""
        return self._pool.closeCachedConnections()


_DONE = Failure(ResponseDone())


class StreamSilent(Exception):
    """A backend body went silent for longer than the idle timeout."""


class _BodyRelay(Protocol):
    """Writes each chunk of a backend body to the client as it arrives.

    A timer restarted by every chunk ends the relay when the backend goes
    silent: a long generation is never cut, a stalled one is.
    """

    def __init__(
        self,
        request: Request,
        finished: Deferred[None],
        clock: IReactorTime,
        idle_timeout: float | None,
        on_first_byte: Callable[[], None] | None = None,
    ) -> None:
        self._on_first_byte = on_first_byte
        self._request = request
        self._finished = finished
        self._clock = clock
        self._idle_timeout = idle_timeout
        self._timer: IDelayedCall | None = None

    def connectionMade(self) -> None:
        if self._request.channel is not None:
            self._request.registerProducer(self.transport, True)
        self._restart_timer()

    def dataReceived(self, data: bytes) -> None:
        if self._on_first_byte is not None:
            first, self._on_first_byte = self._on_first_byte, None
            first()
        self._restart_timer()
        self._request.write(data)

    def _restart_timer(self) -> None:
        if self._idle_timeout is None:
            return
        if self._timer is not None and self._timer.active():
            self._timer.reset(self._idle_timeout)
        else:
            self._timer = self._clock.callLater(self._idle_timeout, self._silent)

    def _silent(self) -> None:
        self._timer = None
        self.stop()
        if not self._finished.called:
            self._finished.errback(
                StreamSilent(f"no data from the backend for {self._idle_timeout:g} s")
            )

    def stop(self) -> None:
        """Close the backend connection (vLLM then aborts the request)."""
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()

    def connectionLost(self, reason: Failure = _DONE) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        if self._request.channel is not None and self._request.producer is not None:
            self._request.unregisterProducer()
        if self._finished.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self._finished.callback(None)
        else:
            self._finished.errback(reason)


def start_response(request: IRequest, response: IResponse) -> None:
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


def relay_body(
    request: Request,
    response: IResponse,
    clock: IReactorTime | None = None,
    idle_timeout: float | None = None,
    on_first_byte: Callable[[], None] | None = None,
) -> Deferred[None]:
    """Relay a backend body to the client; fires when the backend's body ended.

    Fails with ``StreamSilent`` after ``idle_timeout`` seconds without data.
    Cancelling the Deferred closes the backend connection, which makes vLLM
    abort the request and free its KV blocks.
    """
    if clock is None:
        from twisted.internet import reactor as default_clock

        clock = cast(IReactorTime, default_clock)
    finished: Deferred[None] = Deferred(lambda _: relay.stop())
    relay = _BodyRelay(request, finished, clock, idle_timeout, on_first_byte)
    response.deliverBody(relay)
    return finished


class _Discard(Protocol):
    def connectionMade(self) -> None:
        cast(IPushProducer, self.transport).stopProducing()


def abandon(response: IResponse) -> None:
    """Close a backend response nobody will read (its client has left)."""
    response.deliverBody(_Discard())


class BodyTooLarge(Exception):
    """A backend body that should be small (prefill, errors) was not."""


class _Collector(Protocol):
    def __init__(self, finished: Deferred[bytes], limit: int) -> None:
        self._finished = finished
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._limit:
            self.stop()
            if not self._finished.called:
                self._finished.errback(BodyTooLarge(f"more than {self._limit} bytes"))
            return
        self._parts.append(data)

    def stop(self) -> None:
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()

    def connectionLost(self, reason: Failure = _DONE) -> None:
        if self._finished.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self._finished.callback(b"".join(self._parts))
        else:
            self._finished.errback(reason)


#: A prefill answer is one token and its kv_transfer_params: far below this.
MAX_SMALL_BODY = 16 * 1024 * 1024


def read_body(response: IResponse, limit: int = MAX_SMALL_BODY) -> Deferred[bytes]:
    """Read a whole small backend body (a prefill answer, an error).

    Cancelling it closes the backend connection (treq's ``content`` would
    leave the body streaming in).
    """
    finished: Deferred[bytes] = Deferred(lambda _: collector.stop())
    collector = _Collector(finished, limit)
    response.deliverBody(collector)
    return finished
