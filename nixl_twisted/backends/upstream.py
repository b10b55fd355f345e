"""Calls to vLLM instances: treq over an agent the composition root hands in.

The hot-path work here is what the profile justified (``docs/performance.md``):
treq would rebuild each URL (hyperlink parsing, IDNA) and each endpoint per
call, copy each body through a cooperator task, and run ``http.cookiejar`` on
every request and response. Each of those is done once, or not at all, here.
A small backend body (a prefill answer, an error, a health check) is read
whole by ``read_body``; bodies relayed to clients are ``nixl_twisted.exchange.relay``'s.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, cast

from hyperlink import EncodedURL
from treq.client import HTTPClient
from treq.cookies import IndexableCookieJar
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IConsumer,
    IHostnameResolver,
    IPushProducer,
    IReactorTCP,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    ResponseDone,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import (
    IAgent,
    IAgentEndpointFactory,
    IBodyProducer,
    IPolicyForHTTPS,
    IResponse,
)
from zope.interface import implementer

from nixl_twisted.backends.connections import QuietFactory
from nixl_twisted.backends.names import BackendResolver, ResolvingWith, threaded_lookup


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

    #: Set by ``encoded_url`` only; a URL derived from this one (``replace``)
    #: has none and behaves as any ``EncodedURL``.
    _text: str | None = None

    def to_uri(self) -> EncodedURL:
        return self if self._text is not None else super().to_uri()

    def to_text(self, with_password: bool = False) -> str:
        if self._text is not None and not with_password:
            return self._text
        return str(super().to_text(with_password))


@lru_cache(maxsize=1024)
def encoded_url(text: str) -> EncodedURL:
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
class BytesBody:
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

    def __init__(
        self,
        reactor: IReactorTCP,
        connect_timeout: float,
        tls: IPolicyForHTTPS,
        resolver: IHostnameResolver,
    ) -> None:
        self._reactor = ResolvingWith(reactor, resolver)
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


def backend_agent(
    reactor: IReactorTCP,
    connections: HTTPConnectionPool,
    connect_timeout: float,
    tls: IPolicyForHTTPS | None = None,
    resolver: IHostnameResolver | None = None,
) -> IAgent:
    """The agent for every backend call: one endpoint per backend, pooled connections.

    ``tls`` decides which certificates an ``https`` backend may show (by
    default, the system's trusted roots, as a browser would); ``resolver``
    finds a host's addresses (by default ``getaddrinfo`` in the reactor's
    threads, every failure said: ``nixl_twisted.backends.names``).
    """
    if resolver is None:
        resolver = BackendResolver(threaded_lookup(reactor))
    tls = tls or BrowserLikePolicyForHTTPS()
    endpoints = _Endpoints(reactor, connect_timeout, tls, resolver)
    connections._factory = QuietFactory
    return Agent.usingEndpointFactory(reactor, endpoints, pool=connections)


class Upstream:
    """The proxy's HTTP client for every backend call, over one connection pool."""

    def __init__(self, agent: IAgent, connections: HTTPConnectionPool | None = None) -> None:
        """``connections``: the pool behind ``agent``, closed by :meth:`close`."""
        self._connections = connections
        self._http = HTTPClient(agent, cookiejar=_NoCookies(), data_to_body_producer=BytesBody)

    def post(self, url: str, body: bytes, headers: Headers) -> Deferred[IResponse]:
        """POST a JSON body; the response's body is left unread for the caller.

        Cancelling closes the connection and fails with ``CancelledError``.
        """
        return self._send("POST", url, headers, body)

    def get(self, url: str, headers: Headers) -> Deferred[IResponse]:
        """GET a resource; the response's body is left unread for the caller."""
        return self._send("GET", url, headers)

    def _send(
        self, method: str, url: str, headers: Headers, body: bytes | None = None
    ) -> Deferred[IResponse]:
        """The call, whose every error is a failure of its Deferred, never raised.

        What an agent raises before it connects (an endpoint made for a new
        host, say) then ends the leg as any connection error does.
        """
        try:
            sent = self._http.request(
                method,
                encoded_url(url),
                data=body,
                headers=headers,
                allow_redirects=False,
                unbuffered=True,
            )
        except Exception:
            return fail()
        return sent.addErrback(_as_cancelled)  # type: ignore[return-value]

    def keep_idle(self, per_host: int, seconds: float) -> None:
        """Idle connections kept per instance, and for how long (from the next one on)."""
        if self._connections is not None:
            self._connections.maxPersistentPerHost = per_host
            self._connections.cachedConnectionTimeout = seconds  # type: ignore[assignment]

    def close(self) -> Deferred[None]:
        """Close every idle pooled connection (on service stop)."""
        if self._connections is None:
            return succeed(None)
        return self._connections.closeCachedConnections()


def pooled_upstream(
    reactor: Any, connect_timeout: float, idle_per_host: int, idle: float
) -> Upstream:
    """A pooled HTTP client on the reactor, keeping ``idle_per_host`` connections ``idle`` s."""
    connections = HTTPConnectionPool(reactor, persistent=True)
    connections.maxPersistentPerHost = idle_per_host
    connections.cachedConnectionTimeout = idle  # type: ignore[assignment]
    return Upstream(backend_agent(reactor, connections, connect_timeout), connections)


_DONE = Failure(ResponseDone())


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
