"""The errors a client can see, rendered as OpenAI-style JSON bodies."""

from __future__ import annotations

import json

from twisted.web.iweb import IRequest

from nixl_twisted.protocol.routes import speaks_anthropic


class ProxyError(Exception):
    """A request ended in an answer the proxy itself composes.

    ``error_type`` and ``code`` follow the OpenAI error body: a broad class
    (``invalid_request_error``, ``upstream_error``, ...) and a stable
    machine-readable code that operators can alert on.
    """

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        code: str,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        #: Seconds after which trying again may succeed (sent as Retry-After).
        self.retry_after = retry_after

    def body(self) -> bytes:
        """The JSON body sent to the client."""
        return error_body(self.message, self.error_type, self.code)


def error_body(message: str, error_type: str, code: str) -> bytes:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode("utf-8")


#: Anthropic's error types for ours, on the Messages routes.
_ANTHROPIC_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "overloaded_error": "overloaded_error",
}


def anthropic_error_body(message: str, error_type: str, status: int) -> bytes:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    if status == 404:
        kind = "not_found_error"
    elif status == 413:
        kind = "request_too_large"
    else:
        kind = _ANTHROPIC_TYPES.get(error_type, "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def for_route(path: bytes, status: int, message: str, error_type: str, code: str) -> bytes:
    """The proxy's error body in the shape the route's clients parse."""
    if speaks_anthropic(path):
        return anthropic_error_body(message, error_type, status)
    return error_body(message, error_type, code)


def stream_error_event(path: bytes, message: str, code: str) -> bytes:
    """The in-band SSE event that ends a stream which broke off, in the route's shape."""
    if speaks_anthropic(path):
        return (
            b"event: error\ndata: " + anthropic_error_body(message, "upstream_error", 502) + b"\n\n"
        )
    return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"


def invalid_request(message: str, code: str) -> ProxyError:
    """A 400: the client's request cannot be served as sent."""
    return ProxyError(400, message, "invalid_request_error", code)


def overloaded(message: str, code: str, retry_after: float = 1.0) -> ProxyError:
    """A 503: the proxy will not take this request now; try again soon."""
    return ProxyError(503, message, "overloaded_error", code, retry_after=retry_after)


def bad_gateway(message: str, code: str) -> ProxyError:
    """A 502: a backend could not be reached or answered something unusable."""
    return ProxyError(502, message, "upstream_error", code)


def gateway_timeout(message: str, code: str) -> ProxyError:
    """A 504: a backend did not answer in time."""
    return ProxyError(504, message, "upstream_error", code)


def json_answer(request: IRequest, status: int, body: bytes) -> bytes:
    """Set ``request`` up to answer ``body``, a JSON error, with ``status``; returns the body."""
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    request.setHeader(b"Content-Length", str(len(body)).encode("ascii"))
    return body
