"""The Klein app: the proxy's routes, input checks and error mapping.

A request that sends a leg is read once at the door (``web.door``), held to
its tenant's limits (``Tenancy``) and the proxy's (``Admission``), and
served by ``Serving``: a completion as two legs (``exchange.two_legs``), a
batch of them, or one leg to a decode instance.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import partial

from klein import Klein
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import Request
from werkzeug.exceptions import HTTPException, NotFound

from nixl_twisted.admission import Admission, Counted, Tenancy
from nixl_twisted.backends.models import listing
from nixl_twisted.config import ProxyConfig, TenantRule
from nixl_twisted.exchange.prefill import PrefillRefused
from nixl_twisted.exchange.relay import start_response
from nixl_twisted.exchange.serving import Serving
from nixl_twisted.observe.access import record_of
from nixl_twisted.observe.metrics import CONTENT_TYPE
from nixl_twisted.observe.observed import Observed
from nixl_twisted.observe.spans import NO_TRACE, RequestTrace
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Relayed
from nixl_twisted.protocol.errors import ProxyError, error_answer, json_answer, late_answer_event
from nixl_twisted.protocol.headers import IDENTITY, REQUEST_ID
from nixl_twisted.web import door
from nixl_twisted.web.admin import AdminAPI
from nixl_twisted.web.backends_view import BackendsView
from nixl_twisted.web.front import FrontDoor
from nixl_twisted.web.status import StatusPage

log = Logger()

_JSON = b"application/json"

#: What the router's refusals are called, by their status (Werkzeug's exceptions).
_ROUTING_CODES = {code.status: code for code in (ErrorCode.NOT_FOUND, ErrorCode.METHOD_NOT_ALLOWED)}


class ProxyApp:
    """The proxy's HTTP face: its routes, input checks and error mapping.

    Everything it serves with is made by the composition root
    (``run.root.build``) and handed in; a request is read at the door
    (``web.door``), held to its tenant's limits and the proxy's, and served
    by ``Serving``.
    """

    app = Klein()
    # No route has an empty segment: ``/v1//models`` is a 404, not Werkzeug's 308
    # (a doubled leading slash, ``//v1/models``, is not merged by this and routes
    # as Werkzeug reads it)
    # (set before the routes below are added: each rule reads it then).
    app.url_map.merge_slashes = False

    def __init__(
        self,
        config: ProxyConfig,
        view: BackendsView,
        serving: Serving,
        admission: Admission,
        tenancy: Tenancy,
        admin: AdminAPI,
        observed: Observed,
        status: StatusPage,
    ) -> None:
        #: The pools, as /healthcheck shows them.
        self.view = view
        self.backends = view.backends
        self.serving = serving
        self.admission = admission
        #: Whose each request is, and its tenant's limits.
        self.tenancy = tenancy
        self.admin = admin
        self.metrics = observed.metrics
        #: Each request to a backend route is a trace (when tracing is on).
        self.tracing = observed.tracing
        #: Overload refusals and 5xx lines: counted, logged at most once a second each.
        self.refusals = observed.refusals
        #: ``/healthcheck`` in full and the status page (``docs/status-page.md``).
        self.status = status
        self.configure(config)

    def configure(self, config: ProxyConfig) -> None:
        """The configuration in effect (a reload: from the next request on)."""
        self.config = config
        #: Off when /metrics is served on its own --metrics-listen endpoint.
        self.serve_metrics = config.metrics_listen is None

    def resource(self, admin: bool = False) -> IResource:
        """The Twisted Web resource that serves this app (``admin``: on --admin-listen)."""
        split = self.config.admin_listen is not None
        return FrontDoor(
            self.app.resource(), admin, split, self._identity_headers, self._served_methods
        )

    def _served_methods(self, path: str) -> Iterable[str]:
        """The methods ``path`` is served with, as the router answers a wrong one's ``Allow``."""
        return self.app.url_map.bind("proxy").allowed_methods(path)

    def _identity_headers(self) -> tuple[bytes, ...]:
        """The headers that say who a client is: keys, and the tenant header when set."""
        header = self.tenancy.limits.header
        return IDENTITY if header is None else (*IDENTITY, header)

    @property
    def in_flight(self) -> int:
        """Requests being served now."""
        return self.admission.in_flight

    # -- routes -----------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Both pools have an instance up, and the proxy is not leaving."""
        return self.status.ready

    @app.route(routes.HEALTH, methods=["GET"])
    def health(self, request: Request) -> bytes:
        """vLLM's own probe: 200 with an empty body when ready, else 503."""
        request.setResponseCode(200 if self.ready else 503)
        return b""

    @app.route(routes.HEALTHCHECK, methods=["GET"])
    def healthcheck(self, request: Request) -> bytes:
        ready = self.ready
        request.setResponseCode(200 if ready else 503)
        request.setHeader(b"Content-Type", _JSON)
        if not self.admin.shows_the_backends(request, self.config):
            waiting = self.status.waiting_for()  # (why not ready, when it is Redis)
            said = {"ready": ready} if waiting is None else {"ready": ready, "waiting_for": waiting}
            return json.dumps(said).encode("utf-8")
        return json.dumps(self.status.healthcheck()).encode("utf-8")

    @app.route(routes.STATUS_PAGE, methods=["GET"], endpoint="status_page")
    @app.route(routes.STATUS_JSON, methods=["GET"], endpoint="status_json")
    @app.route(routes.STATUS_SCRIPT, methods=["GET"], endpoint="status_script")
    @app.route(routes.STATUS_STYLE, methods=["GET"], endpoint="status_style")
    def status_page(self, request: Request) -> bytes:
        """The status page, its JSON, script and style: to whoever may see the backends."""
        if not self.admin.shows_the_backends(request, self.config):
            raise ProxyError(
                ErrorCode.UNAUTHORIZED,
                "while clients need a key, the status page on this endpoint needs the admin "
                "token; or serve it on --admin-listen",
            )
        return self.status.answer(request)

    @app.route(routes.METRICS, methods=["GET"])
    def prometheus(self, request: Request) -> bytes:
        if not self.serve_metrics:
            raise NotFound()
        if not self.admin.shows_the_backends(request, self.config):
            raise ProxyError(
                ErrorCode.UNAUTHORIZED,
                "while clients need a key, /metrics on this endpoint needs the admin token "
                "(Authorization: Bearer TOKEN); or serve it on --metrics-listen or --admin-listen",
            )
        request.setHeader(b"Content-Type", CONTENT_TYPE.encode("ascii"))
        return self.metrics.exposition()

    @app.route(routes.ADMIN_BACKENDS, methods=["GET", "POST", "DELETE"])
    def admin_backends(self, request: Request) -> bytes | Deferred[bytes]:
        self.admin.authorize(request)
        if request.method == b"GET":
            return _json(request, 200, self.admin.listing())
        if request.method == b"POST":
            added = self.admin.add(door.client_body(request))
            return added.addCallback(partial(_json, request, 201))
        changed = self.admin.remove(door.client_body(request))
        return changed.addCallback(partial(_json, request, 200))

    @app.route(routes.ADMIN_DRAIN, methods=["POST"])
    def admin_drain(self, request: Request) -> Deferred[bytes]:
        self.admin.authorize(request)
        drained = self.admin.drain(door.client_body(request))
        return drained.addCallback(partial(_json, request, 202))

    @app.route(routes.MODELS, methods=["GET"])
    def models(self, request: Request) -> Deferred[None] | Deferred[bytes] | bytes:
        """What the healthy decode instances serve, each model once; else one instance's say."""
        served = listing(self.backends.decode.instances)
        if served is None:  # (relayed: for any model, whatever is served)
            return self._one_leg(request, door.relayed(request, routes.MODELS, None))
        listed = lambda _: succeed(_json(request, 200, served))  # noqa: E731
        return self.admission.request(request, routes.MODELS, None, listed, Counted.TENANT)

    @app.route(routes.TOKENIZE, methods=["POST"])
    def tokenize(self, request: Request) -> Deferred[None]:
        return self._relayed(request, routes.TOKENIZE)

    @app.route(routes.DETOKENIZE, methods=["POST"])
    def detokenize(self, request: Request) -> Deferred[None]:
        return self._relayed(request, routes.DETOKENIZE)

    @app.route(routes.COUNT_TOKENS, methods=["POST"])
    def count_tokens(self, request: Request) -> Deferred[None]:
        return self._relayed(request, routes.COUNT_TOKENS)

    def _relayed(self, request: Request, path: str) -> Deferred[None]:
        """A one-leg route with a JSON body, to an instance of the model it names."""
        trace = self._trace(request)
        read = door.relayed(
            request, path, door.client_body(request), self.backends.decode.instances
        )
        return self._one_leg(request, read, trace)

    def _one_leg(
        self, request: Request, relayed: Relayed, trace: RequestTrace | None = None
    ) -> Deferred[None]:
        trace = self._trace(request) if trace is None else trace
        # (In flight and requests per minute: no tokens generated.)
        return self.admission.request(
            request, relayed.path, None, lambda _: self.serving.relayed(request, relayed, trace)
        )

    @app.route(routes.COMPLETIONS, methods=["POST"])
    def completions(self, request: Request) -> Deferred[None]:
        return self._two_legs(request, routes.COMPLETIONS)

    @app.route(routes.CHAT_COMPLETIONS, methods=["POST"])
    def chat_completions(self, request: Request) -> Deferred[None]:
        return self._two_legs(request, routes.CHAT_COMPLETIONS)

    @app.route(routes.RESPONSES, methods=["POST"])
    def responses(self, request: Request) -> Deferred[None]:
        return self._two_legs(request, routes.RESPONSES)

    @app.route(routes.MESSAGES, methods=["POST"])
    def messages(self, request: Request) -> Deferred[None]:
        return self._two_legs(request, routes.MESSAGES)

    @app.route(routes.RESPONSE.format(id="<string:response_id>"), methods=["GET"])
    def response(self, request: Request, response_id: str) -> Deferred[None]:
        return self._follow_up(request, routes.response_path(response_id), response_id, None)

    @app.route(routes.RESPONSE_CANCEL.format(id="<string:response_id>"), methods=["POST"])
    def cancel_response(self, request: Request, response_id: str) -> Deferred[None]:
        path = routes.response_path(response_id, cancel=True)
        return self._follow_up(request, path, response_id, door.client_body(request) or b"{}")

    def _follow_up(
        self, request: Request, path: str, response_id: str, body: bytes | None
    ) -> Deferred[None]:
        trace = self._trace(request)
        read = door.relayed(request, path, body)
        door.stored_response(response_id)
        return self.admission.request(
            request, path, None, lambda _: self.serving.follow_up(request, read, response_id, trace)
        )

    def _trace(self, request: Request) -> RequestTrace:
        """The request's trace, begun at its arrival; ended with its access event."""
        if not self.tracing.enabled:
            return NO_TRACE
        record = record_of(request)
        record.trace = self.tracing.request(request, record.started)
        return record.trace

    def _two_legs(self, request: Request, path: str) -> Deferred[None]:
        trace = self._trace(request)
        limits, record = self.config.limits, record_of(request)
        decode = self.backends.decode.instances
        read = door.completion(
            request, record, path, limits.max_batch_prompts, decode, limits.max_n
        )
        trace.note_request(read)

        def serve(rule: TenantRule) -> Deferred[None]:
            # As its tenant's rule sends it (a tenant's tokens are counted from the stream's
            # usage, asked for the proxy's sake), and in its tenant's place in the queue.
            tenant = record.tenant
            admitted = read if tenant is None else read.admitted(tenant, rule)
            if admitted.ttft_target is not None:  # (its outcome counted in its tenant's class)
                record.ttft_target, record.tenant_class = admitted.ttft_target, rule.outcome_class
            return self.serving.completion(request, admitted, trace)

        return self.admission.request(request, path, read, serve)

    def shut_down(self) -> None:
        """The drain timeout ended: every completion still running is cut, and told why."""
        self.serving.shut_down()

    # -- errors -----------------------------------------------------------

    @app.handle_errors(ProxyError)
    def proxy_error(self, request: IRequest, failure: Failure) -> bytes:
        """A ``ProxyError``, as the route's JSON error; a refusal counted, a 5xx logged."""
        error = failure.value
        assert isinstance(error, ProxyError)
        record = record_of(request)
        record.error = error.detail
        if error.ended is not None:
            record.ended = error.ended
        code = error.code
        if code.error_type == "overloaded_error":
            record.refused = True
            self.refusals.refused(code, error.message)
        elif error.status >= 500:
            said = f"{error.status} {code.value} for {_request_id(request)}: {error.detail}"
            self.refusals.throttle.emit(code.value, LogLevel.error, said)
        return error_answer(request, error)

    @app.handle_errors(PrefillRefused)
    def prefill_refused(self, request: IRequest, failure: Failure) -> bytes:
        refused = failure.value
        assert isinstance(refused, PrefillRefused)
        if getattr(request, "startedWriting", 0):  # (``--sse-keepalive``: in-band)
            request.setResponseCode(refused.response.code)
            return late_answer_event(request.path, refused.response.code, refused.body)
        start_response(request, refused.response)
        request.responseHeaders.setRawHeaders(
            b"Content-Length", [str(len(refused.body)).encode("ascii")]
        )
        return refused.body

    @app.handle_errors(HTTPException)
    def http_exception(self, request: IRequest, failure: Failure) -> bytes:
        """What the router refuses (no such route, a wrong method), as JSON."""
        http_error = failure.value
        assert isinstance(http_error, HTTPException)
        code = _ROUTING_CODES.get(http_error.code or 500)
        if code is None:  # none the router raises today: not the client's doing
            return self.unexpected(request, failure)
        for name, value in http_error.get_response().headers:
            if name.lower() == "allow":
                request.setHeader(b"Allow", value.encode("ascii"))
        method = request.method.decode("ascii", "replace")
        path = request.path.decode("utf-8", "replace")
        return json_answer(request, ProxyError(code, f"{method} {path}: {http_error.name}"))

    @app.handle_errors(Exception)
    def unexpected(self, request: IRequest, failure: Failure) -> bytes:
        log.failure("unexpected error serving {path}", failure, path=request.path)
        message = "the proxy failed unexpectedly; see its log"
        record_of(request).error = f"{message}: {failure.getErrorMessage()}"
        return error_answer(request, ProxyError(ErrorCode.INTERNAL_ERROR, message))


def _request_id(request: IRequest) -> str | None:
    values = request.responseHeaders.getRawHeaders(REQUEST_ID)
    return values[0].decode("ascii") if values else None


def _json(request: IRequest, status: int, value: object) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", _JSON)
    return json.dumps(value).encode("utf-8")
