"""The prefill leg: one attempt, and what prefill's answer means.

The decode leg's attempt is ``decode.decode_attempt``; this is prefill's,
whose answer is read whole (it is one token and its ``kv_transfer_params``)
and judged by its status alone (``classify_prefill``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, TimeoutError
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.upstream import read_body
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.sending import (
    PrefillRefused,
    Retry,
    account,
    full,
    reason_of,
    unreachable,
)
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import AttemptTrace
from nixl_twisted.protocol import lowering
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.handoff import BadHandoff, check_handoff, kv_transfer_params_of

log = Logger()

#: No ``--allowed-backends``: any handoff host but the cloud metadata services.
_ANY = AllowedBackends()

#: The ``problem`` of an answer without usable params, by its error code.
_UNUSABLE = {
    ErrorCode.MISSING_KV_TRANSFER_PARAMS: "missing",
    ErrorCode.INVALID_KV_TRANSFER_PARAMS: "not_object",
}


class PrefillVerdict(enum.Enum):
    """What a prefill instance's status says, and so what the proxy does next."""

    #: 2xx: read ``kv_transfer_params`` and go on to decode.
    PARAMS = "params"
    #: 502, 503, 504: vLLM is overloaded or restarting; mark it down, try another.
    RETRY = "retry"
    #: 4xx: the request is at fault; relay prefill's answer, no decode.
    REFUSED = "refused"
    #: Anything else (1xx, 3xx, another 5xx): 502, the instance stays up.
    FAILED = "failed"


def classify_prefill(status: int) -> PrefillVerdict:
    """The one place that decides what a prefill answer's status means."""
    if 200 <= status < 300:
        return PrefillVerdict.PARAMS
    if status in (502, 503, 504):
        return PrefillVerdict.RETRY
    if 400 <= status < 500:
        return PrefillVerdict.REFUSED
    return PrefillVerdict.FAILED


async def prefill_attempt(
    legs: Legs,
    instance: Instance,
    span: AttemptTrace,
    target: str,
    lowered: bytes,
    headers: Headers,
    answered: Callable[[int], None],
    judged: bool = True,
) -> bytes:
    """Prefill's whole 2xx body, or why not (``Retry``: another instance may serve).

    ``answered(status)`` is called as soon as prefill has answered, before
    its body is read: the handoff begins there. ``judged``: an error status
    counts toward ejecting the instance (not a leg whose handle may be at fault).
    """
    url = instance.base + target
    try:
        response = await legs.backends.upstream.post(url, lowered, span.headers(url, headers))
    except (CancelledError, TimeoutError):
        raise
    except Exception as error:
        raise unreachable(instance, error) from None
    status = response.code
    answered(status)
    span.answered(status)
    try:
        answer = await read_body(response)
    except (CancelledError, TimeoutError):
        raise
    except Exception as error:
        raise ProxyError(
            ErrorCode.PREFILL_INVALID_RESPONSE,
            "the prefill instance broke off its answer",
            detail=f"prefill instance {instance.url} broke off its answer: {reason_of(error)}",
        ) from None
    verdict = classify_prefill(status)
    failed = ProxyError(
        ErrorCode.PREFILL_FAILED,
        f"the prefill instance answered HTTP {status}",
        detail=f"prefill instance {instance.url} answered HTTP {status}",
    )
    if status == 503:
        raise full(instance)  # (vLLM's engine queue is full: not a failure of the instance)
    if verdict is PrefillVerdict.RETRY:
        raise Retry(failed, "error_status", f"answered HTTP {status}")
    if verdict is PrefillVerdict.FAILED:
        # It answered (it is up), but a 5xx counts toward ejecting it a while (outliers).
        pool = legs.backends.prefill
        legs.metrics.child(
            legs.metrics.backend_requests, pool.role, instance.url, "error_status"
        ).inc()
        if judged:
            pool.record_error(instance, f"answered HTTP {status}")
    elif verdict is not PrefillVerdict.PARAMS:
        # It answered: the error is this request's, not the instance's.
        account(legs.metrics, legs.backends.prefill, instance, "error_status")
    if verdict is not PrefillVerdict.PARAMS:
        raise PrefillRefused(response, answer) if verdict is PrefillVerdict.REFUSED else failed
    return answer


def handed_over(
    metrics: ProxyMetrics,
    instance: Instance,
    answer: Any,
    request_id: str,
    allowed: AllowedBackends = _ANY,
) -> lowering.JSONObject:
    """Prefill's ``kv_transfer_params``, checked (``protocol.handoff``) before decode is sent.

    Params decode could not pull with (none, not an object, a key missing or
    wrong, no blocks), or whose ``remote_host`` ``allowed`` refuses (a cloud
    metadata address, a host outside ``--allowed-backends``: decode's NIXL
    handshake would go there), are the instance's failure, not the
    request's: counted by problem, said in a warning line, and ``Retry``
    (another prefill instance, then ``--prefill-fallback``). They never
    reach decode, which would compute the prompt itself without a word.
    """
    try:
        params = kv_transfer_params_of(answer, instance.url)
        check_handoff(params)
        refused = allowed.host_refusal(params["remote_host"])
        if refused is not None:
            raise BadHandoff("disallowed_host", f"remote_host {refused}")
    except ProxyError as error:
        problem = _UNUSABLE[error.code]
        metrics.missing_kv_transfer_params.inc()
        said, failed = error.message, error
    except BadHandoff as bad:
        problem, said = bad.problem, str(bad)
        failed = ProxyError(
            ErrorCode.BAD_HANDOFF,
            "the prefill instance's kv_transfer_params name a remote_host the proxy does not allow"
            if problem == "disallowed_host"
            else "the prefill instance's kv_transfer_params cannot be pulled from",
            detail=f"prefill instance {instance.url} handed over bad kv_transfer_params: {said}",
        )
    else:
        return params
    metrics.child(metrics.bad_handoffs, instance.url, problem).inc()
    log.warn(
        "prefill instance {url} handed over kv_transfer_params decode cannot pull with, "
        "for {request_id}: {said}; not sent to decode (another prefill instance, if any)",
        url=instance.url,
        request_id=request_id,
        said=said,
    )
    raise Retry(failed, "bad_handoff", f"bad kv_transfer_params: {said}")
