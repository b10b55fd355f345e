"""The Klein app: the proxy's routes, input checks and error mapping.

Each completion is two legs: the lowered body to the next prefill instance,
then the client's body plus prefill's ``kv_transfer_params`` to the next
decode instance, whose answer is relayed to the client as it arrives.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from klein import Klein
from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest, IResponse
from twisted.web.resource import IResource
from twisted.web.server import Request
from werkzeug.exceptions import HTTPException

from nixl_twisted import protocol
from nixl_twisted.errors import ProxyError, bad_gateway, error_body
from nixl_twisted.headers import REQUEST_ID, backend_request_headers
from nixl_twisted.pools import BackendService
from nixl_twisted.upstream import read_body, relay_body, start_response

log = Logger()

_JSON = b"application/json"


class PrefillRefused(Exception):
    """Prefill answered 4xx: the answer describes the client's request."""

    def __init__(self, response: IResponse, body: bytes) -> None:
        super().__init__(response.code)
        self.response = response
        self.body = body


def _describe(failure_or_error: BaseException) -> str:
    return str(failure_or_error) or type(failure_or_error).__name__


class ProxyApp:
    """The proxy's HTTP face, handed the service that owns the backends."""

    app = Klein()

    def __init__(self, backends: BackendService, backend_api_key: str | None = None) -> None:
        self.backends = backends
        self.backend_api_key = backend_api_key

    def resource(self) -> IResource:
        """The Twisted Web resource that serves this app."""
        return self.app.resource()

    # -- routes -----------------------------------------------------------

    @app.route("/healthcheck", methods=["GET"])
    def healthcheck(self, request: Request) -> bytes:
        request.setHeader(b"Content-Type", _JSON)
        return json.dumps(
            {
                "ready": True,
                "prefill_instances": len(self.backends.prefill),
                "decode_instances": len(self.backends.decode),
            }
        ).encode("utf-8")

    @app.route("/v1/models", methods=["GET"])
    async def models(self, request: Request) -> None:
        instance = self.backends.decode.next()
        request_id = protocol.new_request_id()
        request.setHeader(REQUEST_ID, request_id.encode("ascii"))
        headers = backend_request_headers(
            request.requestHeaders, request_id, self.backend_api_key, json_body=False
        )
        response = await self._reach(
            "decode", instance, self.backends.upstream.get(instance + "/v1/models", headers)
        )
        await self._relay(request, response, request_id)

    @app.route(protocol.COMPLETIONS_PATH, methods=["POST"])
    async def completions(self, request: Request) -> None:
        await self._two_legs(request, protocol.COMPLETIONS_PATH)

    @app.route(protocol.CHAT_COMPLETIONS_PATH, methods=["POST"])
    async def chat_completions(self, request: Request) -> None:
        await self._two_legs(request, protocol.CHAT_COMPLETIONS_PATH)

    # -- the two legs -----------------------------------------------------

    async def _two_legs(self, request: Request, path: str) -> None:
        # The id comes first, so that every answer, refusals included, has one.
        request_id = protocol.new_request_id()
        request.setHeader(REQUEST_ID, request_id.encode("ascii"))
        body = protocol.parse_client_body(_client_body(request))
        protocol.check_servable(path, body)
        headers = backend_request_headers(request.requestHeaders, request_id, self.backend_api_key)
        target = path + _query(request)

        prefill = self.backends.prefill.next()
        prefill_response = await self._reach(
            "prefill",
            prefill,
            self.backends.upstream.post(
                prefill + target,
                protocol.encode(protocol.prefill_body(body, request_id)),
                headers,
            ),
        )
        prefill_answer = await self._read("prefill", prefill, prefill_response)
        if 400 <= prefill_response.code < 500:
            raise PrefillRefused(prefill_response, prefill_answer)
        if prefill_response.code >= 300 or prefill_response.code < 200:
            raise bad_gateway(
                f"prefill instance {prefill} answered HTTP {prefill_response.code}",
                "prefill_failed",
            )
        kv_transfer_params = protocol.extract_kv_transfer_params(prefill_answer, prefill)

        decode = self.backends.decode.next()
        decode_response = await self._reach(
            "decode",
            decode,
            self.backends.upstream.post(
                decode + target,
                protocol.encode(protocol.decode_body(body, kv_transfer_params)),
                headers,
            ),
        )
        await self._relay(request, decode_response, request_id)
        log.info(
            "relayed {request_id} {path}: prefill {prefill}, decode {decode} answered {status}",
            request_id=request_id,
            path=path,
            prefill=prefill,
            decode=decode,
            status=decode_response.code,
        )

    async def _reach(self, leg: str, instance: str, call: Any) -> IResponse:
        """Await a backend call; not reaching the instance is a 502 naming it."""
        try:
            response: IResponse = await call
        except CancelledError:
            raise
        except Exception as error:
            raise bad_gateway(
                f"{leg} instance {instance} could not be reached: {_describe(error)}",
                f"{leg}_unreachable",
            ) from None
        return response

    async def _read(self, leg: str, instance: str, response: IResponse) -> bytes:
        try:
            return await read_body(response)
        except CancelledError:
            raise
        except Exception as error:
            raise bad_gateway(
                f"{leg} instance {instance} broke off its answer: {_describe(error)}",
                f"{leg}_invalid_response",
            ) from None

    async def _relay(self, request: Request, response: IResponse, request_id: str) -> None:
        """Relay a backend answer; a body cut short is never passed off as whole."""
        start_response(request, response)
        try:
            await relay_body(request, response)
        except CancelledError:
            raise
        except Exception as error:
            log.error(
                "backend body for {request_id} broke off: {reason}",
                request_id=request_id,
                reason=_describe(error),
            )
            await _break_off(request)

    # -- errors -----------------------------------------------------------

    @app.handle_errors(ProxyError)
    def proxy_error(self, request: IRequest, failure: Failure) -> bytes:
        error = failure.value
        assert isinstance(error, ProxyError)
        if error.status >= 500:
            log.error(
                "{status} {code}: {message}",
                status=error.status,
                code=error.code,
                message=error.message,
            )
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
        return _error(
            request,
            status,
            error_body(message, "invalid_request_error", http_error.name.lower().replace(" ", "_")),
        )

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


def _query(request: Request) -> str:
    """The client's query string, passed on to both legs."""
    _, mark, query = request.uri.partition(b"?")
    return ("?" + query.decode("ascii", "replace")) if mark else ""


def _client_body(request: Request) -> bytes:
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    return bytes(content.read())


def _error(request: IRequest, status: int, body: bytes) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", _JSON)
    request.setHeader(b"Content-Length", str(len(body)).encode("ascii"))
    return body


async def _break_off(request: Request) -> None:
    """End a response whose backend body broke off, so the client can tell.

    An event stream gets an in-band error event first. Then the connection
    is closed without the final chunk (or short of the announced length),
    and Klein must not finish the request as if it were complete.
    """
    channel = request.channel
    if channel is None:
        return
    content_type = request.responseHeaders.getRawHeaders(b"content-type", [b""])[0]
    if content_type.startswith(b"text/event-stream"):
        request.write(
            b"data: "
            + error_body(
                "the decode stream broke off before it was complete",
                "upstream_error",
                "decode_stream_broken",
            )
            + b"\n\n"
        )
    lost = request.notifyFinish()
    channel.loseConnection()
    with contextlib.suppress(Exception):
        await lost
