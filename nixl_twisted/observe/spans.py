"""The spans of one request: a server span for the client's request, a client span per leg attempt.

``RequestTrace`` and ``AttemptTrace`` are what the proxy's code calls; their
base classes are tracing off and do nothing (no span, no header touched,
nothing allocated), so the hot path pays nothing for them. ``ServerSpan``
and its legs are tracing on. Contexts are passed explicitly, span to span,
never through ``contextvars`` across Deferreds: each leg attempt's span is
the parent named in the ``traceparent`` that attempt sends, so vLLM's own
spans nest under it.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from twisted.web.http import Request
from twisted.web.http_headers import Headers

from nixl_twisted.observe.carriers import GETTER, SETTER
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.lowering import printable
from nixl_twisted.protocol.phases import Phase
from nixl_twisted.protocol.routes import route_label

if TYPE_CHECKING:
    from nixl_twisted.backends.instances import Instance


class Figures(Protocol):
    """What a request's span ends with: its access record's figures (``access.AccessRecord``).

    A protocol, so that the record (which holds the request's trace) and
    the trace (which reads the record) do not import each other.
    """

    request_id: str | None
    prefill_seconds: float | None
    handoff_gap_seconds: float | None
    decode_first_byte_seconds: float | None
    time_to_first_byte_seconds: float | None
    started: float
    phase: Phase | None
    ended: str
    error: str | None
    mode: str | None
    decided_by: str | None
    tenant: str | None


class AttemptTrace:
    """One attempt of a leg, as a span; this base is tracing off, and does nothing."""

    def headers(self, url: str, headers: Headers) -> Headers:
        """The headers of its request to ``url``, carrying its trace context when traced."""
        return headers

    def answered(self, status: int) -> None:
        """The instance answered ``status`` (an error from 400 on)."""

    def fail(self, reason: str, phase: str | None = None) -> None:
        """The attempt failed; the first reason given is the one kept."""

    def end(self) -> None:
        """The leg is over (its lease released)."""


class RequestTrace:
    """One client request, as a server span; this base is tracing off, and does nothing."""

    def note_request(self, completion: Completion) -> None:
        """What the request asks for: its model, streamed or not."""

    def attempt(self, instance: Instance, decision: str, policy: str, number: int) -> AttemptTrace:
        """A span for one attempt of a leg to ``instance``, started now."""
        return NO_ATTEMPT

    def moving(self, number: int, token: int, source: str) -> None:
        """The legs from now on continue the answer ``source`` failed at ``token``."""

    def end(self, request: Request, record: Figures) -> None:
        """The request is over: its figures, its status, and the span ended."""


NO_ATTEMPT = AttemptTrace()
NO_TRACE = RequestTrace()


class _AttemptSpan(AttemptTrace):
    def __init__(self, span: trace.Span, context: Context) -> None:
        self._span = span
        self._context = trace.set_span_in_context(span, context)
        self._failed = False
        self._ended = False

    def headers(self, url: str, headers: Headers) -> Headers:
        # Without the client's query, which may carry anything (the server span has none).
        self._span.set_attribute("url.full", url.partition("?")[0])
        carried = headers.copy()
        # Replaces the client's traceparent/tracestate: vLLM's parent is this attempt.
        propagate.inject(carried, context=self._context, setter=SETTER)
        return carried

    def answered(self, status: int) -> None:
        self._span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.fail(f"answered HTTP {status}")

    def fail(self, reason: str, phase: str | None = None) -> None:
        if self._failed or self._ended:
            return
        self._failed = True
        self._span.set_status(Status(StatusCode.ERROR, reason))
        if phase is not None:
            self._span.set_attribute("nixlproxy.phase", phase)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._span.end()


class _UnsampledAttempt(AttemptTrace):
    """A leg of a request not recorded: it records nothing, and only tells vLLM so.

    Its headers carry the request's own context, flagged unsampled, so that
    vLLM records nothing either; no span of its own is made for it.
    """

    def __init__(self, context: Context) -> None:
        carrier = Headers()
        propagate.inject(carrier, context=context, setter=SETTER)
        self._carried = list(carrier.getAllRawHeaders())

    def headers(self, url: str, headers: Headers) -> Headers:
        carried = headers.copy()
        for name, values in self._carried:
            carried.setRawHeaders(name, list(values))
        return carried


@lru_cache(maxsize=256)
def _origin(base: str) -> tuple[str, int]:
    """An instance's host (a name or a bare IP) and port, as HTTP's conventions name the server."""
    parts = urlsplit(base)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname or "", port


def _outcome(request: Request, record: Figures) -> dict[str, str | int | float]:
    """What the server span says once its request is over (what did not happen is left out)."""
    said: dict[str, str | int | float | None] = {
        "nixlproxy.request_id": record.request_id,
        # Only once an answer was begun: a client that left before has none.
        "http.response.status_code": request.code if request.startedWriting else None,
        "nixlproxy.prefill_seconds": record.prefill_seconds,
        "nixlproxy.handoff_gap_seconds": record.handoff_gap_seconds,
        "nixlproxy.decode_first_byte_seconds": record.decode_first_byte_seconds,
        "nixlproxy.time_to_first_byte_seconds": record.time_to_first_byte_seconds,
        "nixlproxy.total_seconds": time.monotonic() - record.started,
        "nixlproxy.phase": None if record.phase is None else record.phase.value,
        "nixlproxy.ended": record.ended,
        "nixlproxy.mode": record.mode,
        "nixlproxy.decided_by": record.decided_by,
        "nixlproxy.tenant": record.tenant,
    }
    return {name: value for name, value in said.items() if value is not None}


class ServerSpan(RequestTrace):
    """A client request's trace, when tracing is on (``nixl_twisted.observe.tracing`` makes it)."""

    def __init__(self, tracer: trace.Tracer, request: Request, arrived: float) -> None:
        self._tracer = tracer
        #: The client's context (its traceparent, tracestate, baggage), if it sent one.
        self._parent = propagate.extract(request.requestHeaders, getter=GETTER)
        method = request.method.decode("ascii", "replace")
        route = route_label(request.path)
        started = time.time_ns() - int((time.monotonic() - arrived) * 1e9)
        self._span = tracer.start_span(
            f"{method} {route}",
            context=self._parent,
            kind=SpanKind.SERVER,
            start_time=started,
            attributes={
                "http.request.method": method,
                "http.route": route,
                "url.path": request.path.decode("utf-8", "replace")[:200],
            },
        )
        self._context = trace.set_span_in_context(self._span, self._parent)
        #: Not sampled: its legs make no spans, only say so to vLLM (a cheap path).
        self._unsampled = None if self._span.is_recording() else _UnsampledAttempt(self._context)
        #: What its legs' spans say of the move they are part of (none: the first legs).
        self._moved: dict[str, str | int] = {}

    def note_request(self, completion: Completion) -> None:
        if self._unsampled is not None:
            return
        model = completion.model
        described: dict[str, str | bool] = {"nixlproxy.stream": completion.stream}
        if isinstance(model, str):  # (a lone surrogate would fail the whole export)
            described["gen_ai.request.model"] = printable(model)
        self._span.set_attributes(described)

    def attempt(self, instance: Instance, decision: str, policy: str, number: int) -> AttemptTrace:
        if self._unsampled is not None:
            return self._unsampled
        host, port = _origin(instance.base)
        attributes: dict[str, str | int] = {
            "nixlproxy.instance": instance.url,
            "server.address": host,
            "server.port": port,
            "nixlproxy.policy": policy,
            "nixlproxy.decision": decision,
            "nixlproxy.attempt": number,
        }
        if instance.rank is not None:
            attributes["nixlproxy.dp_rank"] = instance.rank
        attributes.update(self._moved)
        span = self._tracer.start_span(
            instance.role, context=self._context, kind=SpanKind.CLIENT, attributes=attributes
        )
        return _AttemptSpan(span, self._parent)

    def moving(self, number: int, token: int, source: str) -> None:
        if self._unsampled is not None:
            return
        self._moved = {
            "nixlproxy.migration": number,
            "nixlproxy.migrated_at_token": token,
            "nixlproxy.migrated_from": source,
        }
        self._span.add_event("migration", self._moved)

    def end(self, request: Request, record: Figures) -> None:
        if self._unsampled is not None:
            return  # a span not recorded has nothing to end
        span = self._span
        span.set_attributes(_outcome(request, record))
        failure = _failure(request, record)
        if failure is not None:
            span.set_status(Status(StatusCode.ERROR, failure))
        # Its legs end with their leases, on their own: a decode sent after its
        # client left (to free prefill's blocks) ends when decode has answered.
        span.end()


def _failure(request: Request, record: Figures) -> str | None:
    """Why the request failed, as the server span's error status says; None if it did not."""
    during = f" during {record.phase.value}" if record.phase is not None else ""
    if record.ended == "client_left":
        return f"client left{during}"
    if record.ended == "client_slow":
        return f"client read nothing{during}"
    if record.ended == "shutting_down":
        return "the proxy is shutting down: its drain timeout ended"
    if record.ended == "broken":
        return record.error or f"the answer broke off{during}"
    if request.code >= 500:
        return record.error or f"HTTP {request.code}"
    return None
