"""The decode leg's one attempt (``decode_attempt``), what it sends, and the handoff's gap.

What a decode leg sends is the same to whichever instance serves it
(``DecodeRequest``): a completion's decode body after its handoff, or a
single-leg route's request as the client sent it. The prefill leg's attempt
is ``prefill.prefill_attempt``; the leg around each, ``prefill_leg`` and
``decode_leg`` (and ``one_leg`` for the single-leg routes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from nixl_twisted.backends.instances import Instance
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.relay import abandon
from nixl_twisted.exchange.sending import account, full, timed_out, unreachable
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import AttemptTrace
from nixl_twisted.protocol.headers import for_rank

log = Logger()


@dataclass(frozen=True)
class DecodeRequest:
    """What a decode leg sends, the same to whichever instance serves it."""

    #: The path and query, after the instance's base URL.
    target: str
    #: The JSON body to POST; None: a GET.
    body: bytes | None
    headers: Headers
    #: Seconds for decode's response headers (``--decode-timeout``).
    timeout: float
    #: A 503 (vLLM's engine queue full) is retried on another instance, not relayed.
    full_is_retried: bool = False
    #: A 2xx is judged when its body ends (the leg's: a decode that breaks its answers
    #: counts toward being marked down), not as its headers come.
    judged_by_body: bool = False


def _as_it_is(waiting: Deferred[IResponse]) -> Deferred[IResponse]:
    return waiting


async def decode_attempt(
    legs: Legs,
    instance: Instance,
    span: AttemptTrace,
    request: DecodeRequest,
    record: AccessRecord,
    track: Callable[[Deferred[IResponse]], Deferred[IResponse]] = _as_it_is,
) -> IResponse:
    """``request`` to ``instance``, and its response headers; the body is the caller's.

    A completion's decode leg and the single-leg routes alike. ``track``
    is shown what is awaited (to cancel it). No headers within the
    timeout: a 504, counted against the instance. Unreachable: a
    ``Retry`` (nothing reached the client, another instance may serve).
    """
    record.decode = instance.url
    url = instance.base + request.target
    headers = span.headers(url, for_rank(request.headers, instance.rank))
    upstream = legs.backends.upstream
    sent = (
        upstream.get(url, headers)
        if request.body is None
        else upstream.post(url, request.body, headers)
    )
    pool = legs.backends.decode
    try:
        response = await track(sent.addTimeout(request.timeout, legs.clock))
    except TimeoutError:
        account(legs.metrics, pool, instance, "timeout", "decode timed out")
        raise timed_out(instance, request.timeout) from None
    except CancelledError:
        raise
    except Exception as error:
        raise unreachable(instance, error) from None
    span.answered(response.code)
    if response.code == 503 and request.full_is_retried:
        abandon(response)
        raise full(instance)  # (vLLM's engine queue is full: another instance is asked)
    # An answer, even an error (a KV-load failure is a 500), shows the
    # instance is up: only silence, refusals and answers broken off take it out.
    # A 5xx still counts toward ejecting it a while (``backends.outliers``).
    if response.code < 400 and request.judged_by_body:
        legs.metrics.child(legs.metrics.backend_requests, pool.role, instance.url, "answered").inc()
    elif response.code >= 500 and response.code != 503:  # (503: its engine is full)
        legs.metrics.child(
            legs.metrics.backend_requests, pool.role, instance.url, "error_status"
        ).inc()
        pool.record_error(instance, f"answered HTTP {response.code}")
    else:
        account(legs.metrics, pool, instance, "answered" if response.code < 400 else "error_status")
    return response


def note_handoff(
    metrics: ProxyMetrics, gap: float, warning: float, request_id: str, url: str
) -> bool:
    """Prefill answered -> decode sent: observed; past ``warning``, counted and logged.

    vLLM frees prefill's blocks when its KV lease (30 s) expires: a decode
    sent later fails to load them or computes them again. Returns whether it warned.
    """
    metrics.handoff_gap.observe(gap)
    if gap <= warning:
        return False
    metrics.handoff_gap_over_warning.inc()
    log.warn(
        "handoff gap of {seconds:.1f} s for {request_id} (decode {url}): past "
        "--handoff-warning; vLLM's KV lease is 30 s",
        seconds=gap,
        request_id=request_id,
        url=url,
    )
    return True
