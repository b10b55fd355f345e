"""The single-leg routes: relayed to the next decode instance as they are.

``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize`` need no
prefill: one leg to a decode instance, with the same guarantees as a
completion's decode leg (retries before the first byte, ``--decode-timeout``
for the headers, ``--stream-idle-timeout`` for the body, a body that breaks
off never passed off as complete). A JSON body's ``kv_transfer_params`` is
the proxy's to set, never the client's: it is dropped before the leg.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from twisted.internet.defer import CancelledError, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.iweb import IResponse
from twisted.web.server import Request

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.exchange.legs import (
    Retry,
    account,
    describe,
    hold,
    outcome_of,
    send_leg,
    timed_out,
    unreachable,
)
from nixl_twisted.exchange.relay import abandon, break_off, relay_body, start_response
from nixl_twisted.observe.access import record_of
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import LegTrace, RequestTrace
from nixl_twisted.protocol import lowering
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import REQUEST_ID, backend_request_headers, for_rank

log = Logger()


class OneLeg:
    """Serves a single-leg route: the request to the next decode instance, its answer back."""

    def __init__(
        self,
        config: ProxyConfig,
        backends: BackendService,
        metrics: ProxyMetrics,
        clock: IReactorTime,
    ) -> None:
        self.config = config
        self.backends = backends
        self.metrics = metrics
        self.clock = clock

    async def serve(
        self, request: Request, path: str, body: bytes | None, trace: RequestTrace
    ) -> None:
        """Relay ``request`` to decode's ``path``; ``body`` is JSON to pass on (POST)."""
        attempt = self._attempt(request, path, body)
        pool = self.backends.decode
        retries = self.config.retries.decode
        lease, (response, leg) = await send_leg(
            pool, retries, self.metrics, attempt, trace=trace, record=record_of(request)
        )
        await self._relay(request, path, lease, response, leg)

    async def follow_up(
        self,
        request: Request,
        path: str,
        body: bytes | None,
        first: str | None,
        trace: RequestTrace,
    ) -> None:
        """Relay to the instance that holds the resource (``first``), else ask each in turn.

        An instance that answers 404 does not hold it: the next is asked, and
        the last one's answer is the client's. Down and draining instances are
        asked too: what they stored is still theirs.
        """
        attempt = self._attempt(request, path, body)
        pool = self.backends.decode
        order = sorted(pool.instances, key=lambda instance: instance.url != first)
        record = record_of(request)
        last: Exception | None = None
        for index, instance in enumerate(order):
            left = len(order) - 1 - index
            decision = "holder" if instance.url == first else "asked"
            lease, leg = hold(pool, instance, decision, trace, index + 1)
            try:
                response, _ = await attempt(instance, leg)
            except Retry as retry:
                leg.fail(retry.down)
                lease.release()
                account(self.metrics, pool, instance, retry.outcome, retry.down)
                record.attempted("decode", instance.url, retry.outcome, index > 0)
                last = retry.error
                continue
            except BaseException as error:
                leg.fail(describe(error))
                lease.release()
                record.attempted("decode", instance.url, outcome_of(error), index > 0)
                raise
            record.attempted("decode", instance.url, f"answered_{response.code}", index > 0)
            if response.code == 404 and left > 0:
                abandon(response)
                lease.release()
                continue
            await self._relay(request, path, lease, response, leg)
            return
        raise (
            last
            if last is not None
            else ProxyError(ErrorCode.NOT_FOUND, "no decode instance holds it")
        )

    def _attempt(
        self, request: Request, path: str, body: bytes | None
    ) -> Callable[[Instance, LegTrace], Awaitable[tuple[IResponse, LegTrace]]]:
        """One attempt at the leg: decode's response, and the span it goes on in."""
        request_id = lowering.new_request_id()
        request.setHeader(REQUEST_ID, request_id.encode("ascii"))
        record_of(request).request_id = request_id
        raw: bytes | None = None
        if body is not None:
            parsed = lowering.parse_client_body(body)  # a 400 before any backend
            parsed.pop("kv_transfer_params", None)
            raw = lowering.encode(parsed)
        headers = backend_request_headers(
            request.requestHeaders, request_id, self.config.backend_api_key,
            json_body=raw is not None,
        )  # fmt: skip
        timeout = self.config.timeouts.decode
        upstream = self.backends.upstream
        pool = self.backends.decode

        async def attempt(instance: Instance, leg: LegTrace) -> tuple[IResponse, LegTrace]:
            record_of(request).decode = instance.url
            url = instance.base + path
            ranked = leg.headers(url, for_rank(headers, instance.rank))
            sent = upstream.get(url, ranked) if raw is None else upstream.post(url, raw, ranked)
            try:
                response = await sent.addTimeout(timeout, self.clock)
            except TimeoutError:
                account(self.metrics, pool, instance, "timeout", "decode timed out")
                raise timed_out(instance, timeout) from None
            except CancelledError:
                raise
            except Exception as error:
                raise unreachable(instance, error) from None
            outcome = "answered" if response.code < 400 else "error_status"
            account(self.metrics, pool, instance, outcome)
            leg.answered(response.code)
            return response, leg

        return attempt

    async def _relay(
        self, request: Request, path: str, lease: Lease, response: IResponse, leg: LegTrace
    ) -> None:
        record = record_of(request)
        record.decode_status = response.code
        try:
            start_response(request, response)
            await relay_body(request, response, self.clock, self.config.timeouts.stream_idle)
        except CancelledError:
            leg.fail("client left during relay", "relay")
            raise
        except Exception as error:
            log.error("{path} from {url} broke off: {reason}",
                      path=path, url=lease.instance.url, reason=describe(error))  # fmt: skip
            leg.fail(f"broke off: {describe(error)}", "relay")
            record.ended, record.error = "broken", "decode closed its answer early"
            await break_off(request, record.error, ErrorCode.DECODE_BROKEN)
        finally:
            lease.release()
