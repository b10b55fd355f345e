"""The errors a client can see, rendered as OpenAI-style JSON bodies.

Each carries an :class:`~nixl_twisted.protocol.codes.ErrorCode`, which says
its status and type: a raise site names the code and says what happened.
"""

from __future__ import annotations

import json
import math

from twisted.web.iweb import IRequest

from nixl_twisted.protocol.codes import ErrorCode, ErrorType
from nixl_twisted.protocol.routes import speaks_anthropic


class ProxyError(Exception):
    """A request ended in an answer the proxy itself composes.

    ``code`` gives the OpenAI error body its ``type`` and ``code``, and the
    answer its status; ``status`` is given only for a code without one of
    its own (a batch answers with its failing part's).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        retry_after: float | None = None,
        status: int | None = None,
        detail: str | None = None,
        ended: str | None = None,
    ) -> None:
        """``detail``: what the log and the access event say instead of ``message``,
        which the client gets (an instance's address is for the operator only);
        ``ended``: the access event's ``ended``, when the answer alone does not say it."""
        super().__init__(detail if detail is not None else message)
        if code.status is not None and status is not None:
            raise ValueError(f"{code.value} is always a {code.status}: give no status")
        answered = code.status if code.status is not None else status
        if answered is None:
            raise ValueError(f"{code.value} has no status of its own: give one")
        self.code = code
        self.status = answered
        self.message = message
        #: Seconds after which trying again may succeed (sent as Retry-After).
        self.retry_after = retry_after
        #: What the operator reads: the message with the instance and the cause.
        self.detail = detail if detail is not None else message
        self.ended = ended


def error_body(message: str, code: ErrorCode) -> bytes:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return _openai_body(message, code.error_type, code)


def _openai_body(message: str, error_type: ErrorType, code: ErrorCode) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code.value}}
    ).encode("utf-8")


#: Anthropic's error types for ours, on the Messages routes.
_ANTHROPIC_TYPES: dict[ErrorType, str] = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "overloaded_error": "overloaded_error",
    "rate_limit_error": "rate_limit_error",
}


_PHRASES = {429: b"Too Many Requests"}


def anthropic_error_body(message: str, error_type: ErrorType, status: int) -> bytes:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    if status == 404:
        kind = "not_found_error"
    elif status == 413:
        kind = "request_too_large"
    else:
        kind = _ANTHROPIC_TYPES.get(error_type, "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def for_route(path: bytes, error: ProxyError) -> bytes:
    """The proxy's error body in the shape the route's clients parse."""
    if speaks_anthropic(path):
        return anthropic_error_body(error.message, error.code.error_type, error.status)
    return error_body(error.message, error.code)


def stream_error_event(path: bytes, message: str, code: ErrorCode) -> bytes:
    """The in-band SSE event that ends a stream which broke off, in the route's shape.

    Its type is ``upstream_error`` whatever the code's: the stream's answer
    was the backend's, and it broke.
    """
    if speaks_anthropic(path):
        return (
            b"event: error\ndata: " + anthropic_error_body(message, "upstream_error", 502) + b"\n\n"
        )
    return b"data: " + _openai_body(message, "upstream_error", code) + b"\n\n"


def late_error_event(path: bytes, error: ProxyError) -> bytes:
    """``error`` as the one SSE event that ends a stream whose headers already went out
    (``--sse-keepalive``): the body its status would have carried, in the route's shape."""
    if speaks_anthropic(path):
        body = anthropic_error_body(error.message, error.code.error_type, error.status)
        return b"event: error\ndata: " + body + b"\n\n"
    return b"data: " + error_body(error.message, error.code) + b"\n\n"


def late_answer_event(path: bytes, status: int, body: bytes) -> bytes:
    """A backend's error answer (prefill's 4xx, decode's error) as the SSE event that ends a
    stream whose headers already went out: its JSON body on one line, else its text as
    the message of an OpenAI error."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        text = body.decode("utf-8", "replace").strip() or f"the backend answered {status}"
        error = {"message": text, "type": "upstream_error", "param": None, "code": status}
        parsed = {"error": error}
    data = json.dumps(parsed, separators=(",", ":")).encode("utf-8")
    return (b"event: error\n" if speaks_anthropic(path) else b"") + b"data: " + data + b"\n\n"


def error_answer(request: IRequest, error: ProxyError) -> bytes:
    """``error`` as the request's answer: JSON with its status, or, once the headers went
    out (``--sse-keepalive``), the in-band event; the access event and the metrics then
    say the status it would have had (the client has its 200)."""
    if getattr(request, "startedWriting", 0):  # (``IRequest`` does not declare it)
        request.setResponseCode(error.status, _PHRASES.get(error.status))
        return late_error_event(request.path, error)
    return json_answer(request, error)


def json_answer(request: IRequest, error: ProxyError) -> bytes:
    """Set ``request`` up to answer ``error`` as JSON in the route's shape; returns the body."""
    # (Twisted's table has no phrase for 429: its status line would say "Unknown Status".)
    request.setResponseCode(error.status, _PHRASES.get(error.status))
    if error.retry_after is not None:
        request.setHeader(b"Retry-After", str(max(1, math.ceil(error.retry_after))).encode())
    body = for_route(request.path, error)
    request.setHeader(b"Content-Type", b"application/json")
    request.setHeader(b"Content-Length", str(len(body)).encode("ascii"))
    return body
