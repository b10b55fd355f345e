"""The Klein app: the proxy's routes, input checks, admission and error mapping.

Each completion is an ``Exchange`` (``nixl_twisted.exchange``): the lowered
body to the next prefill instance, then the client's body plus prefill's
``kv_transfer_params`` to the next decode instance, whose answer is relayed
to the client as it arrives.
"""

from __future__ import annotations

import json
import math
import os
from urllib.parse import unquote_to_bytes

from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request
from werkzeug.exceptions import HTTPException, NotFound

from nixl_twisted import protocol
from nixl_twisted.access import record_of
from nixl_twisted.admin import AdminAPI
from nixl_twisted.errors import ProxyError, bad_gateway, error_body, overloaded
from nixl_twisted.exchange import Exchange, Limits, PrefillRefused, break_off, unavailable
from nixl_twisted.headers import REQUEST_ID, backend_request_headers
from nixl_twisted.metrics import CONTENT_TYPE, ProxyMetrics
from nixl_twisted.pools import BackendService, NoHealthyInstance
from nixl_twisted.upstream import relay_body, start_response

log = Logger()

_JSON = b"application/json"
DEFAULT_MAX_IN_FLIGHT = 1024


class ProxyApp:
    """The proxy's HTTP face, handed the service that owns the backends."""

    app = Klein()

    def __init__(
        self,
        backends: BackendService,
        backend_api_key: str | None = None,
        limits: Limits | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        clock: IReactorTime | None = None,
        metrics: ProxyMetrics | None = None,
        serve_metrics: bool = True,
        admin_token: str | None = None,
    ) -> None:
        self.backends = backends
        self.backend_api_key = backend_api_key
        self.limits = limits or Limits()
        self.max_in_flight = max_in_flight
        self.clock = clock or backends.clock
        self.metrics = metrics or ProxyMetrics(backends.pools())
        #: Off when /metrics is served on its own --metrics-listen endpoint.
        self.serve_metrics = serve_metrics
        self.admin = AdminAPI(backends, admin_token)
        self._in_flight = 0
        self.metrics.in_flight.set_function(lambda: self._in_flight)
        #: The completions being served now.
        self.exchanges: set[Exchange] = set()
        self.draining = False
        self._idle: list[Deferred[None]] = []

    def resource(self) -> IResource:
        """The Twisted Web resource that serves this app."""
        return _UTF8Only(self.app.resource())

    @property
    def in_flight(self) -> int:
        """Requests being served now."""
        return self._in_flight

    # -- admission and draining ---------------------------------------------

    def _admit(self) -> None:
        if self.draining:
            raise overloaded("the proxy is shutting down", "draining")
        if self._in_flight >= self.max_in_flight:
            raise overloaded(
                f"the proxy is serving its limit of {self.max_in_flight} requests",
                "too_many_requests_in_flight",
            )
        self._in_flight += 1

    def _release(self, result: object) -> object:
        self._in_flight -= 1
        if self._in_flight == 0:
            idle, self._idle = self._idle, []
            for waiting in idle:
                waiting.callback(None)
        return result

    def start_draining(self) -> None:
        """Refuse new requests from now on; /healthcheck says not ready."""
        self.draining = True

    def drain(self) -> Deferred[None]:
        """Refuse new requests; fires when those in flight have ended."""
        self.start_draining()
        if self._in_flight == 0:
            return succeed(None)
        waiting: Deferred[None] = Deferred()
        self._idle.append(waiting)
        return waiting

    # -- routes -----------------------------------------------------------

    @app.route("/healthcheck", methods=["GET"])
    def healthcheck(self, request: Request) -> bytes:
        ready = self.backends.ready() and not self.draining
        request.setResponseCode(200 if ready else 503)
        request.setHeader(b"Content-Type", _JSON)
        return json.dumps(
            {
                "ready": ready,
                "prefill_instances": len(self.backends.prefill),
                "decode_instances": len(self.backends.decode),
                "draining": self.draining,
                "in_flight": self.in_flight,
                "pid": os.getpid(),
                "instances": {
                    pool.role: [i.describe() for i in pool.instances]
                    for pool in self.backends.pools()
                },
            }
        ).encode("utf-8")

    @app.route("/metrics", methods=["GET"])
    def prometheus(self, request: Request) -> bytes:
        if not self.serve_metrics:
            raise NotFound()
        request.setHeader(b"Content-Type", CONTENT_TYPE.encode("ascii"))
        return self.metrics.exposition()

    @app.route("/admin/backends", methods=["GET", "POST", "DELETE"])
    def admin_backends(self, request: Request) -> bytes:
        self.admin.authorize(request)
        if request.method == b"GET":
            return _json(request, 200, self.admin.listing())
        if request.method == b"POST":
            return _json(request, 201, self.admin.add(_client_body(request)))
        return _json(request, 200, self.admin.remove(_client_body(request)))

    @app.route("/admin/backends/drain", methods=["POST"])
    def admin_drain(self, request: Request) -> bytes:
        self.admin.authorize(request)
        return _json(request, 202, self.admin.drain(_client_body(request)))

    @app.route("/v1/models", methods=["GET"])
    def models(self, request: Request) -> Deferred[None]:
        self._admit()
        return Deferred.fromCoroutine(self._models(request)).addBoth(self._release)

    async def _models(self, request: Request) -> None:
        request_id = protocol.new_request_id()
        request.setHeader(REQUEST_ID, request_id.encode("ascii"))
        record_of(request).request_id = request_id
        try:
            instance = self.backends.decode.next()
        except NoHealthyInstance as error:
            raise unavailable(error) from None
        record_of(request).decode = instance.url
        headers = backend_request_headers(
            request.requestHeaders, request_id, self.backend_api_key, json_body=False
        )
        try:
            response = await self.backends.upstream.get(instance.url + "/v1/models", headers)
        except CancelledError:
            raise
        except Exception as error:
            self.backends.decode.mark_failed(instance, str(error))
            raise bad_gateway(
                f"decode instance {instance.url} could not be reached: {error}",
                "decode_unreachable",
            ) from None
        start_response(request, response)
        try:
            await relay_body(request, response, self.clock, self.limits.stream_idle_timeout)
        except CancelledError:
            raise
        except Exception as error:
            await break_off(request, f"the decode answer broke off: {error}", "decode_broken")

    @app.route(protocol.COMPLETIONS_PATH, methods=["POST"])
    def completions(self, request: Request) -> Deferred[None]:
        return self._two_legs(request, protocol.COMPLETIONS_PATH)

    @app.route(protocol.CHAT_COMPLETIONS_PATH, methods=["POST"])
    def chat_completions(self, request: Request) -> Deferred[None]:
        return self._two_legs(request, protocol.CHAT_COMPLETIONS_PATH)

    def _two_legs(self, request: Request, path: str) -> Deferred[None]:
        # The id comes first, so that every answer, refusals included, has one.
        request_id = protocol.new_request_id()
        request.setHeader(REQUEST_ID, request_id.encode("ascii"))
        record_of(request).request_id = request_id
        body = protocol.parse_client_body(_client_body(request))
        protocol.check_servable(path, body)
        self._admit()
        headers = backend_request_headers(request.requestHeaders, request_id, self.backend_api_key)
        exchange = Exchange(
            request,
            path,
            body,
            request_id,
            headers,
            self.backends,
            self.limits,
            self.clock,
            self.metrics,
        )
        self.exchanges.add(exchange)

        def ended(result: object) -> object:
            self.exchanges.discard(exchange)
            return self._release(result)

        return exchange.start().addBoth(ended)

    # -- errors -----------------------------------------------------------

    @app.handle_errors(ProxyError)
    def proxy_error(self, request: IRequest, failure: Failure) -> bytes:
        error = failure.value
        assert isinstance(error, ProxyError)
        if error.status >= 500:
            log.error(
                "{status} {code} for {request_id}: {message}",
                status=error.status,
                code=error.code,
                message=error.message,
                request_id=_request_id(request),
            )
        if error.retry_after is not None:
            request.setHeader(b"Retry-After", str(max(1, math.ceil(error.retry_after))).encode())
        return _error(request, error.status, error.body())

    @app.handle_errors(PrefillRefused)
    def prefill_refused(self, request: IRequest, failure: Failure) -> bytes:
        refused = failure.value
        assert isinstance(refused, PrefillRefused)
        start_response(request, refused.response)
        request.responseHeaders.setRawHeaders(
            b"Content-Length", [str(len(refused.body)).encode("ascii")]
        )
        return refused.body

    @app.handle_errors(HTTPException)
    def http_error(self, request: IRequest, failure: Failure) -> bytes:
        http_error = failure.value
        assert isinstance(http_error, HTTPException)
        status = http_error.code or 500
        for name, value in http_error.get_response().headers:
            if name.lower() == "allow":
                request.setHeader(b"Allow", value.encode("ascii"))
        method = request.method.decode("ascii", "replace")
        path = request.path.decode("utf-8", "replace")
        message = f"{method} {path}: {http_error.name}"
        code = http_error.name.lower().replace(" ", "_")
        return _error(request, status, error_body(message, "invalid_request_error", code))

    @app.handle_errors(Exception)
    def unexpected(self, request: IRequest, failure: Failure) -> bytes:
        log.failure("unexpected error serving {path}", failure, path=request.path)
        return _error(
            request,
            500,
            error_body(
                "the proxy failed unexpectedly; see its log", "proxy_error", "internal_error"
            ),
        )


class _UTF8Only(Resource):
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
            return _error(request, 400, body)
        return self._app.render(request)


def _request_id(request: IRequest) -> str | None:
    values = request.responseHeaders.getRawHeaders(REQUEST_ID)
    return values[0].decode("ascii") if values else None


def _client_body(request: Request) -> bytes:
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    return bytes(content.read())


def _json(request: IRequest, status: int, value: object) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", _JSON)
    return json.dumps(value).encode("utf-8")


def _error(request: IRequest, status: int, body: bytes) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", _JSON)
    request.setHeader(b"Content-Length", str(len(body)).encode("ascii"))
    return body
