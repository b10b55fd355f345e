"""Calls to vLLM instances: one pooled treq client, and relaying a body as it streams.

The relay registers the backend socket as a push producer on the client's
request, so a client that reads slowly pauses the backend instead of growing
the proxy's memory.
"""

from __future__ import annotations

from http.cookiejar import DefaultCookiePolicy
from typing import cast

from treq import content
from treq.client import HTTPClient
from treq.cookies import IndexableCookieJar
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, IReactorTCP
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import (
    UNKNOWN_LENGTH,
    Agent,
    HTTPConnectionPool,
    ResponseDone,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest, IResponse
from twisted.web.server import Request

from nixl_twisted.headers import client_response_headers

#: vLLM (uvicorn) closes idle keep-alive connections after 5 s; a pooled
#: connection kept as long races with that close and fails a POST.
DEFAULT_IDLE_TIMEOUT = 4.0
#: Idle connections kept per instance. Twisted's default of 2 would make
#: every burst above 2 concurrent legs open (and soon close) new sockets.
DEFAULT_MAX_IDLE_PER_INSTANCE = 512
DEFAULT_CONNECT_TIMEOUT = 10.0


class _NoCookies(DefaultCookiePolicy):
    """A proxy serves many clients: no backend cookie may leak between them."""

    def set_ok(self, cookie: object, request: object) -> bool:
        return False


class Upstream:
    """The proxy's HTTP client for every backend call, over one connection pool."""

    def __init__(
        self,
        reactor: IReactorTCP | None = None,
        *,
        max_idle_per_instance: int = DEFAULT_MAX_IDLE_PER_INSTANCE,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = max_idle_per_instance
        self._pool.cachedConnectionTimeout = idle_timeout  # type: ignore[assignment]
        agent = Agent(reactor, connectTimeout=connect_timeout, pool=self._pool)
        self._http = HTTPClient(agent, cookiejar=IndexableCookieJar(policy=_NoCookies()))

    def post(self, url: str, body: bytes, headers: Headers) -> Deferred[IResponse]:
        """POST a JSON body; the response's body is left unread for the caller."""
        return self._http.request(  # type: ignore[return-value]
            "POST",
            url,
            data=body,
            headers=headers,
            allow_redirects=False,
            unbuffered=True,
        )

    def get(self, url: str, headers: Headers) -> Deferred[IResponse]:
        """GET a resource; the response's body is left unread for the caller."""
        return self._http.request(  # type: ignore[return-value]
            "GET", url, headers=headers, allow_redirects=False, unbuffered=True
        )

    def close(self) -> Deferred[None]:
        """Close every idle pooled connection (on service stop)."""
        return self._pool.closeCachedConnections()


_DONE = Failure(ResponseDone())


class _BodyRelay(Protocol):
    """Writes each chunk of a backend body to the client as it arrives."""

    def __init__(self, request: Request, finished: Deferred[None]) -> None:
        self._request = request
        self._finished = finished

    def connectionMade(self) -> None:
        if self._request.channel is not None:
            self._request.registerProducer(self.transport, True)

    def dataReceived(self, data: bytes) -> None:
        self._request.write(data)

    def connectionLost(self, reason: Failure = _DONE) -> None:
        if self._request.channel is not None:
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


def relay_body(request: Request, response: IResponse) -> Deferred[None]:
    """Relay a backend body to the client; fires when the backend's body ended.

    Cancelling the Deferred (Klein does when the client goes away) closes the
    backend connection, which makes vLLM abort the request.
    """

    def stop_backend(_: Deferred[None]) -> None:
        if relay.transport is not None:
            cast(IPushProducer, relay.transport).stopProducing()

    finished: Deferred[None] = Deferred(stop_backend)
    relay = _BodyRelay(request, finished)
    response.deliverBody(relay)
    return finished


def read_body(response: IResponse) -> Deferred[bytes]:
    """Read a whole (small) backend body: prefill answers and errors."""
    return content(response)
