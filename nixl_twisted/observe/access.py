"""One structured access-log event per client request, its request metrics, its span's end.

The exchange writes what it learns (instances, statuses, leg timings) into
the request's ``AccessRecord``; the site emits the event when the request
ends, finished or abandoned by its client, so every request gets exactly one,
and its trace (``nixl_twisted.observe.tracing``) ends with the same figures.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from twisted.logger import Logger
from twisted.web.http import Request

from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import NO_TRACE, RequestTrace
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.lowering import printable
from nixl_twisted.protocol.phases import Phase
from nixl_twisted.protocol.routes import route_label
from nixl_twisted.protocol.targets import Target
from nixl_twisted.protocol.usage import Usage

log = Logger(namespace="nixlproxy.access")

_USUAL = frozenset({"answered", "next"})

#: The longest path an access event keeps (a 404 for a long URL stays one short line).
MAX_PATH = 200


@dataclass
class AccessRecord:
    """What one request did, filled in as it goes."""

    request_id: str | None = None
    prefill: str | None = None
    prefill_status: int | None = None
    prefill_seconds: float | None = None
    #: Why the pool's policy chose that instance (``nixl_twisted.backends.routing``).
    prefill_route: str | None = None
    decode: str | None = None
    decode_status: int | None = None
    decode_first_byte_seconds: float | None = None
    decode_route: str | None = None
    #: Prompt tokens kv-aware's choice held, by its index (per leg; None: not kv-aware).
    prefill_matched_tokens: int | None = None
    decode_matched_tokens: int | None = None
    #: Whether it took a prefill leg ("pd", "decode_only"), and the rule that decided.
    mode: str | None = None
    decided_by: str | None = None
    #: Prefill's params read -> decode's request sent.
    handoff_gap_seconds: float | None = None
    #: How long it waited in the proxy's queue for its slots (None: it did not wait).
    queued_seconds: float | None = None
    #: Prefilled, how long it waited for its decode slot (None: it took no such wait), and
    #: what was left of its KV lease on prefill when its decode leg went.
    ready_wait_seconds: float | None = None
    kv_lease_left_seconds: float | None = None
    #: The request's arrival -> the first byte written to the client.
    time_to_first_byte_seconds: float | None = None
    #: The last phase a completion entered.
    phase: Phase | None = None
    #: What went wrong, in words, when the proxy answered 5xx or broke off.
    error: str | None = None
    #: The proxy refused it (an ``overloaded_error``: a limit, a full queue, draining).
    refused: bool = False
    #: Its first-token target (None: none), and the class its outcome is counted under
    #: (``TenantRule.outcome_class``).
    ttft_target: Target | None = None
    tenant_class: str = "default"
    #: Its first token as predicted when it entered the proxy's queue (None: not predicted:
    #: no target, no queue, or nothing measured yet; ``admission.predictor``).
    ttft_predicted_seconds: float | None = None
    #: The same before calibration (what the predictor measures its error by).
    ttft_predicted_base_seconds: float | None = None
    #: Its prompt's tokens as estimated from the body (what prefill's time is measured by).
    prompt_estimate: int | None = None
    trace: RequestTrace = NO_TRACE
    #: How it ended, when not simply answered: "broken" (the backend broke
    #: off its answer), "client_left", "client_slow" (its client read nothing
    #: for ``--stream-idle-timeout``: closed), "shutting_down" (cut by the
    #: proxy at its drain timeout).
    ended: str = "answered"
    started: float = field(default_factory=time.monotonic)
    #: The ``model`` the client asked for (bounded, printable).
    model: str | None = None
    #: The model it was routed on, when an instance is known to serve it: the
    #: metrics' ``model`` label, so bounded by what the fleet serves.
    served_model: str = ""
    #: Whose the request is (``admission.tenancy``): a client key's tenant, or the tenant header's.
    tenant: str | None = None
    #: What decode's answer reported using, when it said.
    usage: Usage | None = None
    #: Every attempt of every leg, in order: (leg, instance, outcome).
    attempts: list[tuple[str, str, str]] = field(default_factory=list)
    #: A batched completion's parts, each with its own record.
    parts: list[AccessRecord] = field(default_factory=list)
    #: A leg took more than one attempt (the event then lists them all).
    retried: bool = False
    #: Each move to another decode instance (``FROM@TOKEN -> TO OUTCOME``), and why a
    #: decode failure did not move when it did not (``refused (n)``, ``exhausted``, ...).
    migrations: list[str] = field(default_factory=list)
    migration: str | None = None
    #: With ``--multi-turn-reuse``: what came of reading its conversation's KV back from
    #: decode (``used``, ``mismatch``, ``expired``, ``none``, ...), and the tokens read.
    reuse: str | None = None
    reused_tokens: int | None = None

    def attempted(self, leg: str, instance: str, outcome: str, again: bool = False) -> None:
        """One attempt of a leg; ``again``: not its first."""
        self.attempts.append((leg, instance, outcome))
        if again:
            self.retried = True

    def total_usage(self) -> Usage | None:
        """This request's usage; a batch's, its parts' summed."""
        if not self.parts:
            return self.usage
        reported = [part.usage for part in self.parts if part.usage is not None]
        return sum(reported[1:], reported[0]) if reported else None

    def describe_part(self, index: int) -> str:
        """One part of a batch, in a few words: its request id, legs and how it ended."""
        words = [f"{index}: {self.request_id}"]
        for leg, instance, status in (
            ("prefill", self.prefill, self.prefill_status),
            ("decode", self.decode, self.decode_status),
        ):
            if instance is not None:
                words.append(f"{leg}={instance}" + (f" ({status})" if status else ""))
        if self.mode == "decode_only":
            words.append(f"decode_only ({self.decided_by})")
        if self.retried:
            words.append("attempts=" + ", ".join(" ".join(a) for a in self.attempts))
        if self.ended not in _USUAL:
            words.append(f"ended={self.ended}")
        return " ".join(words)


class Recorded(Protocol):
    """A request the proxy made, which carries its record: a client's, or a batch part's."""

    access: AccessRecord


def record_of(request: object) -> AccessRecord:
    """The request's record (``LimitedRequest`` and ``PartRequest`` each make theirs)."""
    return cast(Recorded, request).access


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


class AccessLog:
    """Emits the access event and counts the request in the metrics."""

    def __init__(self, metrics: ProxyMetrics, emit: bool = True) -> None:
        self.metrics = metrics
        #: ``--access-log off``: the event costs about 80 us per request in
        #: twisted.logger, which a busy proxy may rather spend on requests.
        self.emit = emit

    def first_byte(self, request: Request, waited: float) -> None:
        """The request's first byte of answer was written, ``waited`` seconds after it arrived."""
        record = record_of(request)
        record.time_to_first_byte_seconds = waited
        route = route_label(request.path)
        model = record.served_model
        self.metrics.child(self.metrics.time_to_first_byte, route, model).observe(waited)

    def request_ended(self, request: Request, client_left: bool = False) -> None:
        record = record_of(request)
        if client_left and record.ended == "answered":
            record.ended = "client_left"
        cut = record.ended in ("client_left", "client_slow", "shutting_down") and client_left
        elapsed = time.monotonic() - record.started
        route = route_label(request.path)
        status = record.ended if cut else str(request.code)
        self.metrics.child(self.metrics.requests, route, status, record.served_model).inc()
        if route in routes.TWO_LEG and not client_left:
            self.metrics.request_seconds.observe(elapsed)
        record.trace.end(request, record)
        target = record.ttft_target
        if target is not None:
            outcome = ttft_outcome(target, record, request.code)
            self.metrics.child(self.metrics.ttft_outcomes, record.tenant_class, outcome).inc()
            predicted, actual = record.ttft_predicted_seconds, record.time_to_first_byte_seconds
            if predicted and actual is not None and outcome in ("on_time", "late"):
                self.metrics.ttft_prediction_ratio.observe(actual / predicted)
        if not self.emit:
            return
        path = request.path.decode("utf-8", "replace")
        fields: dict[str, Any] = {
            "client": _client(request),
            "method": request.method.decode("ascii", "replace"),
            "path": printable(path, MAX_PATH),
            "status": request.code,
            "bytes": getattr(request, "sentLength", 0),
            "elapsed_ms": _ms(elapsed),
            "request_id": record.request_id,
            "queued_ms": None if record.queued_seconds is None else _ms(record.queued_seconds),
            "ready_wait_ms": _ms(record.ready_wait_seconds),
            "kv_lease_left_ms": _ms(record.kv_lease_left_seconds),
            "prefill": record.prefill,
            "prefill_status": record.prefill_status,
            "prefill_ms": _ms(record.prefill_seconds),
            "prefill_route": record.prefill_route,
            "decode": record.decode,
            "decode_status": record.decode_status,
            "decode_ttfb_ms": _ms(record.decode_first_byte_seconds),
            "decode_route": record.decode_route,
            "prefill_matched_tokens": record.prefill_matched_tokens,
            "decode_matched_tokens": record.decode_matched_tokens,
            "mode": record.mode,
            "decided_by": record.decided_by,
            "reuse": record.reuse,
            "reused_tokens": record.reused_tokens,
            "model": record.model,
            "tenant": record.tenant,
            "ended": record.ended,
        }
        usage = record.total_usage()
        if usage is not None:
            fields["prompt_tokens"] = usage.prompt_tokens
            fields["completion_tokens"] = usage.completion_tokens
            fields["cached_tokens"] = usage.cached_tokens
        # What did not happen is left out, and so are the usual ending and
        # round-robin's decision ("next"), which say nothing.
        fields = {k: v for k, v in fields.items() if v is not None and v not in _USUAL}
        if record.retried:
            fields["attempts"] = [" ".join(attempt) for attempt in record.attempts]
        if record.parts:
            fields["parts"] = [part.describe_part(i) for i, part in enumerate(record.parts)]
        if record.migrations:
            fields["migrations"] = record.migrations
        if record.migration is not None:
            fields["migration"] = record.migration
        if target is not None:
            fields["ttft_target_ms"] = target.ms
            fields["ttft_target_from"] = target.came_from
            fields["ttft_outcome"] = outcome
            if record.ttft_predicted_seconds is not None:
                fields["ttft_predicted_ms"] = _ms(record.ttft_predicted_seconds)
        # Rendered here: Twisted's own formatting of fifteen fields costs
        # several times more, on every request.
        log.info("{access_line}", access_line=access_line(fields), access=fields)


def ttft_outcome(target: Target, record: AccessRecord, status: int) -> str:
    """How a request with a target fared: its first byte ``on_time`` or ``late`` (the time
    from its arrival, ``AccessLog.first_byte``), else ``refused`` (a 4xx, or the proxy's own
    refusal) or ``failed`` (a 5xx, or no byte written before it ended)."""
    first_byte = record.time_to_first_byte_seconds
    if status < 400 and first_byte is not None:
        return "on_time" if first_byte * 1000 <= target.ms else "late"
    return "refused" if record.refused or 400 <= status < 500 else "failed"


_TOKENS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def access_line(f: dict[str, Any]) -> str:
    """The text access line: what did not happen (no prefill, no decode) is left out.

    What a client chose (method, path, request id, model, tenant) is ``quoted``:
    no client can end the line, forge a field or reach an operator's terminal.
    """
    method, path = quoted(f["method"]), quoted(f["path"])
    parts = [f"{f['client']} {method} {path} {f['status']} {f['bytes']}B {f['elapsed_ms']}ms"]
    if "request_id" in f:
        parts.append(f"request_id={quoted(f['request_id'])}")
    if "queued_ms" in f:
        parts.append(f"queued={f['queued_ms']}ms")
    for leg, timing in (("prefill", "prefill_ms"), ("decode", "decode_ttfb_ms")):
        if leg not in f:
            continue
        details = [str(f[f"{leg}_status"])] if f"{leg}_status" in f else []
        if timing in f:
            details.append(f"{f[timing]}ms" if leg == "prefill" else f"first byte {f[timing]}ms")
        if f"{leg}_route" in f:
            details.append(f"route {f[f'{leg}_route']}")
        if f"{leg}_matched_tokens" in f:
            details.append(f"{f[f'{leg}_matched_tokens']} tokens held")
        parts.append(f"{leg}={f[leg]}" + (f" ({', '.join(details)})" if details else ""))
    if f.get("mode") == "decode_only":
        parts.append(f"mode={f['mode']} ({f['decided_by']})")
    if "reuse" in f:
        reused = f.get("reused_tokens")
        parts.append(f"reuse={f['reuse']}" + (f" ({reused} tokens)" if reused else ""))
    if "model" in f:
        parts.append(f"model={quoted(f['model'])}")
    if "tenant" in f:
        parts.append(f"tenant={quoted(f['tenant'])}")
    tokens = [f"{f[key]} {key.split('_')[0]}" for key in _TOKENS if key in f]
    if tokens:
        parts.append(f"tokens=({', '.join(tokens)})")
    if "attempts" in f:
        parts.append(f"attempts=[{'; '.join(f['attempts'])}]")
    if "parts" in f:
        parts.append(f"parts=[{'; '.join(f['parts'])}]")
    if "migrations" in f:
        parts.append(f"migrated=[{'; '.join(f['migrations'])}]")
    if "migration" in f:
        parts.append(f"migration={quoted(f['migration'])}")
    if "ttft_outcome" in f:
        predicted = f", predicted {f['ttft_predicted_ms']}ms" if "ttft_predicted_ms" in f else ""
        target = f"{f['ttft_target_ms']}ms {f['ttft_target_from']}{predicted}"
        parts.append(f"ttft={f['ttft_outcome']} ({target})")
    if "ended" in f:
        parts.append(f"ended={f['ended']}")
    return " ".join(parts)


#: A word of the text line as it is: printable ASCII, no space, quote or backslash.
_PLAIN = re.compile(r"[!#-\[\]-~]+")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", " ": " "}


def quoted(text: str) -> str:
    """A client's string as one word of the text line: as it is when plain, else in
    double quotes, escaped as a Python string literal would be (``\\"``, ``\\\\``,
    ``\\r``, ``\\n``, ``\\x1b``, ``\\u202e``, ...: every quote, backslash, space
    other than ``" "`` and character that is not printable), so it reads back."""
    if _PLAIN.fullmatch(text) or (text and all(map(_plain, text))):
        return text
    return '"' + "".join(map(_escaped, text)) + '"'


def _plain(char: str) -> bool:
    return char.isprintable() and not char.isspace() and char not in '"\\'


def _escaped(char: str) -> str:
    if char in _ESCAPES:
        return _ESCAPES[char]
    if _plain(char):
        return char
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _client(request: Request) -> str:
    address = request.getClientAddress()
    host = getattr(address, "host", None)
    return f"{host}:{getattr(address, 'port', '')}" if host else str(getattr(address, "name", "-"))
