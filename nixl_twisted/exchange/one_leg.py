"""The single-leg routes: relayed to the next decode instance as they are.

``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize`` need no
prefill: one leg to a decode instance, with the same guarantees as a
completion's decode leg (retries before the first byte, ``--decode-timeout``
for the headers, ``--stream-idle-timeout`` for the body, a body that breaks
off never passed off as complete; decode's handle, which vLLM keeps in a
stored response, taken out). The door read the request
(``protocol.completion.Relayed``: a JSON body's ``kv_transfer_params`` left
out, the proxy's to set, never the client's).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.web.iweb import IResponse
from twisted.web.server import Request

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool, Lease
from nixl_twisted.backends.routing import NO_ROUTING, Routing
from nixl_twisted.exchange.decode import DecodeRequest, decode_attempt
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.relay import (
    ClientSlow,
    abandon,
    break_off,
    close_slow,
    start_response,
)
from nixl_twisted.exchange.relay import relay as relay_passing
from nixl_twisted.exchange.relay_parts import Passes, Silence
from nixl_twisted.exchange.sending import Asked, ByPolicy, Elsewhere, reason_of, send_leg
from nixl_twisted.observe.access import record_of
from nixl_twisted.observe.spans import AttemptTrace, RequestTrace
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Relayed
from nixl_twisted.protocol.decode_handle import HandleTaker, resizing
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import backend_request_headers

log = Logger()


class HolderFirst:
    """A follow-up's instances: the one that holds the response first, then every other.

    Down and draining instances are asked too: what they stored is still
    theirs. None of it is a policy's choice: no routing decision is counted.
    """

    def __init__(self, pool: BackendPool, holder: str | None) -> None:
        self.holder = holder
        self.order = sorted(pool.instances, key=lambda instance: instance.url != holder)
        #: Instances not asked yet, once the next is chosen.
        self.left = len(self.order)

    @property
    def retries(self) -> int:
        """Instances asked after the first."""
        return max(len(self.order) - 1, 0)

    def __call__(self, tried: Sequence[Instance]) -> tuple[Instance, str]:
        if len(tried) >= len(self.order):  # (a pool is never empty: for completeness)
            raise ProxyError(ErrorCode.NOT_FOUND, "no decode instance holds it")
        instance = self.order[len(tried)]
        self.left = len(self.order) - len(tried) - 1
        return instance, "holder" if instance.url == self.holder else "asked"

    def answered(self, served: tuple[IResponse, AttemptTrace]) -> str:
        return f"answered_{served[0].code}"

    def failed(self, instance: Instance) -> None:
        """(Nothing was set going: no policy chose.)"""


async def relay(legs: Legs, request: Request, relayed: Relayed, trace: RequestTrace) -> None:
    """``relayed`` to the next decode instance that serves its model, its answer back."""
    attempt = _attempt(legs, request, relayed)
    pool = legs.backends.decode
    model = relayed.served
    routing = NO_ROUTING if model is None else Routing(model=model)
    retries = legs.config.retries.decode
    lease, (response, span) = await send_leg(
        pool,
        legs.metrics,
        attempt,
        ByPolicy(pool, legs.metrics, routing, retries),
        Asked(trace, record_of(request)),
    )
    await _relay(legs, request, relayed.path, lease, response, span)


async def follow_up(
    legs: Legs, request: Request, relayed: Relayed, holder: str | None, trace: RequestTrace
) -> None:
    """Relay to the instance that holds the resource (``holder``), else ask each in turn.

    An instance that answers 404 does not hold it: the next is asked, and
    the last one's answer is the client's.
    """
    attempt = _attempt(legs, request, relayed)
    asking = HolderFirst(legs.backends.decode, holder)

    async def ask(instance: Instance, span: AttemptTrace) -> tuple[IResponse, AttemptTrace]:
        response, span = await attempt(instance, span)
        if response.code == 404 and asking.left > 0:
            abandon(response)
            raise Elsewhere("answered_404")
        return response, span

    lease, (response, span) = await send_leg(
        legs.backends.decode, legs.metrics, ask, asking, Asked(trace, record_of(request))
    )
    await _relay(legs, request, relayed.path, lease, response, span)


def _attempt(
    legs: Legs, request: Request, relayed: Relayed
) -> Callable[[Instance, AttemptTrace], Awaitable[tuple[IResponse, AttemptTrace]]]:
    """One attempt at the leg: decode's response, and the span it goes on in."""
    config = legs.config
    record = record_of(request)
    headers = backend_request_headers(
        request.requestHeaders,
        relayed.request_id,
        config.backend_api_key,
        json_body=relayed.body is not None,
        keyed=config.keyed,
        forwarded=config.forward_headers,
    )
    sent = DecodeRequest(relayed.path, relayed.body, headers, config.timeouts.decode)

    async def attempt(instance: Instance, span: AttemptTrace) -> tuple[IResponse, AttemptTrace]:
        return await decode_attempt(legs, instance, span, sent, record), span

    return attempt


async def _relay(
    legs: Legs, request: Request, path: str, lease: Lease, response: IResponse, span: AttemptTrace
) -> None:
    record = record_of(request)
    record.decode_status = response.code
    try:
        start_response(request, response)
        # (a stored response keeps decode's handle as vLLM stored it: taken out here too)
        kind = response.headers.getRawHeaders(b"content-type", [b""])[0]
        taken = HandleTaker(
            kind.startswith(b"text/event-stream"), resizing(request.responseHeaders)
        )
        silence = Silence(legs.clock, legs.config.timeouts.stream_idle)
        await relay_passing(request, response, silence, Passes(taken=taken))
    except CancelledError:
        span.fail("client left during relay", "relay")
        raise
    except ClientSlow as slow:  # (the client's doing, not the instance's)
        log.info("{path}: its client read nothing of it: closed (client_slow)", path=path)
        span.fail(str(slow), "relay")
        record.ended = "client_slow"
        await close_slow(request)
    except Exception as error:
        log.error(
            "{path} from {url} broke off: {reason}",
            path=path,
            url=lease.instance.url,
            reason=reason_of(error),
        )
        span.fail(f"broke off: {reason_of(error)}", "relay")
        record.ended, record.error = "broken", "decode closed its answer early"
        await break_off(request, record.error, ErrorCode.DECODE_BROKEN)
    finally:
        lease.release()
