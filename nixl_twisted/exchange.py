"""One client request's two legs, and what a disconnect or a timeout does in each phase.

The phases, and what a client disconnect does in each:

- ``prefill``: the prefill request is cancelled (its connection closed, so
  vLLM frees what it computed) and no decode is sent;
- ``handoff`` (prefill answered, decode not yet): prefill holds KV blocks
  that only decode can free, so the decode leg is still sent and abandoned
  as soon as it answers; decode then tells prefill to free them;
- ``relay``: the decode connection is closed at once.

Timeouts: prefill's whole answer, decode's response headers, and silence
between two chunks of decode's body. Before the client got a byte, a
timeout is a 504; after, the stream ends with an error event (or the
connection is closed short) and is never passed off as complete.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from twisted.internet.defer import CancelledError, Deferred, TimeoutError, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from twisted.web.server import Request

from nixl_twisted import protocol
from nixl_twisted.access import record_of
from nixl_twisted.errors import ProxyError, bad_gateway, error_body
from nixl_twisted.events import Happened
from nixl_twisted.headers import REQUEST_ID
from nixl_twisted.metrics import ProxyMetrics
from nixl_twisted.pools import BackendPool, BackendService, Instance, NoHealthyInstance
from nixl_twisted.upstream import StreamSilent, abandon, read_body, relay_body, start_response

log = Logger()

T = TypeVar("T")

#: vLLM answers these when it is overloaded or restarting: worth another instance.
RETRYABLE_STATUSES = frozenset({502, 503, 504})


@dataclass(frozen=True)
class Limits:
    """Timeouts (seconds) and retry counts, from the options."""

    prefill_timeout: float = 300.0
    decode_timeout: float = 600.0
    stream_idle_timeout: float = 60.0
    prefill_retries: int = 2
    decode_retries: int = 1


class PrefillRefused(Exception):
    """Prefill answered 4xx: the answer describes the client's request."""

    def __init__(self, response: IResponse, body: bytes) -> None:
        super().__init__(response.code)
        self.response = response
        self.body = body


def gateway_timeout(message: str, code: str) -> ProxyError:
    return ProxyError(504, message, "upstream_error", code)


def unavailable(error: NoHealthyInstance) -> ProxyError:
    return ProxyError(
        503,
        f"no healthy {error.role} instance: try again shortly",
        "upstream_error",
        f"no_healthy_{error.role}",
        retry_after=error.retry_after,
    )


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__


class Exchange:
    """Serves one completion: the prefill leg, the decode leg, the relay."""

    def __init__(
        self,
        request: Request,
        path: str,
        body: protocol.JSONObject,
        request_id: str,
        headers: Headers,
        backends: BackendService,
        limits: Limits,
        clock: IReactorTime,
        metrics: ProxyMetrics,
    ) -> None:
        self.request = request
        self.path = path
        self.target = path + _query(request)
        self.body = body
        self.request_id = request_id
        self.headers = headers
        self.backends = backends
        self.limits = limits
        self.clock = clock
        self.phase = "prefill"
        self._reached = {phase: Happened() for phase in ("prefill", "handoff", "relay")}
        self._reached["prefill"].fire()
        self.client_gone = False
        self._current: Deferred[Any] | None = None
        self.metrics = metrics
        self.record = record_of(request)
        self.record.request_id = request_id
        self._decode_sent = 0.0
        self._serving_decode: Instance | None = None

    def start(self) -> Deferred[None]:
        """Run the exchange; the Deferred is the one Klein cancels on disconnect."""
        outcome: Deferred[None] = Deferred(self._client_left)
        running = ensureDeferred(self._run())

        def settle(result: object) -> None:
            if not outcome.called:
                if isinstance(result, Failure):
                    outcome.errback(result)
                else:
                    outcome.callback(None)
            elif isinstance(result, Failure):
                self._after_client_left(result)

        running.addBoth(settle)
        return outcome

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self._reached[phase].fire()

    def reached(self, phase: str) -> Deferred[None]:
        """Fires once the exchange has entered ``phase`` (for tests and operators)."""
        return self._reached[phase].wait()

    def _client_left(self, _: Deferred[None]) -> None:
        self.client_gone = True
        self.metrics.client_disconnects.labels(self.phase).inc()
        log.info(
            "client left {request_id} during {phase}",
            request_id=self.request_id,
            phase=self.phase,
        )
        if self.phase in ("prefill", "relay") and self._current is not None:
            self._current.cancel()

    def _after_client_left(self, failure: Failure) -> None:
        if failure.check(CancelledError, ProxyError, PrefillRefused):
            return
        log.failure(
            "error finishing {request_id} after its client left",
            failure,
            request_id=self.request_id,
        )

    def _track(self, waiting: Deferred[T]) -> Deferred[T]:
        self._current = waiting
        return waiting

    # -- the legs -------------------------------------------------------------

    def _release_decode(self) -> None:
        if self._serving_decode is not None:
            instance, self._serving_decode = self._serving_decode, None
            self.backends.decode.release(instance)

    async def _run(self) -> None:
        try:
            await self._legs()
        finally:
            self._release_decode()

    async def _legs(self) -> None:
        # Prefill is not spent on a request that no decode instance could take.
        for pool in self.backends.pools():
            if not pool.has_available():
                raise unavailable(NoHealthyInstance(pool.role, pool.retry_after()))
        kv_transfer_params = await self._prefill_leg()
        self._enter("handoff")
        response = await self._decode_leg(kv_transfer_params)
        if self.client_gone:
            abandon(response)
            log.info(
                "decode for {request_id} abandoned: its client left before decode answered",
                request_id=self.request_id,
            )
            return
        self._enter("relay")
        # The access event (nixl_twisted.access) reports how it went.
        await self._relay(response)

    def _next(self, pool: BackendPool, tried: list[Instance], last: ProxyError | None) -> Instance:
        try:
            instance = pool.next(exclude=tried)
        except NoHealthyInstance as error:
            if last is not None:
                raise last from None
            raise unavailable(error) from None
        tried.append(instance)
        return instance

    def _account(
        self, pool: BackendPool, instance: Instance, outcome: str, down: str | None = None
    ) -> None:
        """Count a leg's outcome, and take the instance out when ``down`` says why."""
        self.metrics.backend_requests.labels(pool.role, instance.url, outcome).inc()
        if down is None:
            pool.mark_ok(instance)
        else:
            pool.mark_failed(instance, down)

    def _retrying(self, pool: BackendPool, tried: list[Instance]) -> None:
        if tried:
            self.metrics.retries.labels(pool.role).inc()

    async def _prefill_leg(self) -> protocol.JSONObject:
        pool = self.backends.prefill
        lowered = protocol.encode(protocol.prefill_body(self.body, self.request_id))
        tried: list[Instance] = []
        last: ProxyError | None = None
        for _ in range(1 + self.limits.prefill_retries):
            if self.client_gone:
                # Nobody to answer and no blocks held yet: no more prefill attempts.
                raise CancelledError()
            self._retrying(pool, tried)
            instance = self._next(pool, tried, last)
            self.record.prefill = instance.url
            self._enter("prefill")
            started = self.clock.seconds()
            pool.acquire(instance)
            attempt = ensureDeferred(self._prefill_attempt(instance, lowered))
            attempt.addBoth(_passing(pool.release, instance))
            try:
                status, answer = await self._track(
                    attempt.addTimeout(self.limits.prefill_timeout, self.clock)
                )
            except TimeoutError:
                self._account(pool, instance, "timeout", "prefill timed out")
                raise gateway_timeout(
                    f"prefill instance {instance.url} did not answer within "
                    f"{self.limits.prefill_timeout:g} s",
                    "prefill_timeout",
                ) from None
            except _Unreachable as error:
                self._account(pool, instance, "unreachable", str(error))
                last = bad_gateway(
                    f"prefill instance {instance.url} could not be reached: {error}",
                    "prefill_unreachable",
                )
                continue
            if status in RETRYABLE_STATUSES:
                self._account(pool, instance, "error_status", f"answered HTTP {status}")
                last = bad_gateway(
                    f"prefill instance {instance.url} answered HTTP {status}", "prefill_failed"
                )
                continue
            # It answered: an error here is this request's, not the instance's.
            self._account(pool, instance, "answered" if status < 400 else "error_status")
            if status >= 500:
                raise bad_gateway(
                    f"prefill instance {instance.url} answered HTTP {status}", "prefill_failed"
                )
            try:
                params = protocol.extract_kv_transfer_params(answer, instance.url)
            except ProxyError as error:
                if error.code in ("missing_kv_transfer_params", "invalid_kv_transfer_params"):
                    self.metrics.missing_kv_transfer_params.inc()
                raise
            self.record.prefill_seconds = self.clock.seconds() - started
            self.metrics.prefill_seconds.observe(self.record.prefill_seconds)
            return params
        assert last is not None
        raise last

    async def _prefill_attempt(self, instance: Instance, lowered: bytes) -> tuple[int, bytes]:
        try:
            response = await self.backends.upstream.post(
                instance.url + self.target, lowered, self.headers
            )
        except (CancelledError, TimeoutError):
            raise
        except Exception as error:
            raise _Unreachable(_describe(error)) from None
        # Prefill has answered: from here a disconnect must not stop decode.
        self._enter("handoff")
        self.record.prefill_status = response.code
        try:
            answer = await read_body(response)
        except (CancelledError, TimeoutError):
            raise
        except Exception as error:
            raise bad_gateway(
                f"prefill instance {instance.url} broke off its answer: {_describe(error)}",
                "prefill_invalid_response",
            ) from None
        if 300 <= response.code < 500 or response.code < 200:
            self._account(self.backends.prefill, instance, "error_status")
            if response.code >= 400:
                raise PrefillRefused(response, answer)
            raise bad_gateway(
                f"prefill instance {instance.url} answered HTTP {response.code}",
                "prefill_failed",
            )
        return response.code, answer

    async def _decode_leg(self, kv_transfer_params: protocol.JSONObject) -> IResponse:
        pool = self.backends.decode
        completed = protocol.encode(protocol.decode_body(self.body, kv_transfer_params))
        tried: list[Instance] = []
        last: ProxyError | None = None
        for _ in range(1 + self.limits.decode_retries):
            self._retrying(pool, tried)
            instance = self._next(pool, tried, last)
            self.record.decode = instance.url
            self._decode_sent = self.clock.seconds()
            posting = self.backends.upstream.post(
                instance.url + self.target, completed, self.headers
            )
            # Held until the relay ends (released in _run), or this attempt fails.
            pool.acquire(instance)
            self._serving_decode = instance
            try:
                response = await self._track(
                    posting.addTimeout(self.limits.decode_timeout, self.clock)
                )
            except TimeoutError:
                self._account(pool, instance, "timeout", "decode timed out")
                self._release_decode()
                raise gateway_timeout(
                    f"decode instance {instance.url} did not answer within "
                    f"{self.limits.decode_timeout:g} s",
                    "decode_timeout",
                ) from None
            except CancelledError:
                self._release_decode()
                raise
            except Exception as error:
                # Nothing reached the client yet: the same params may go to
                # another decode instance.
                self._release_decode()
                self._account(pool, instance, "unreachable", _describe(error))
                last = bad_gateway(
                    f"decode instance {instance.url} could not be reached: {_describe(error)}",
                    "decode_unreachable",
                )
                continue
            # An answer, even an error (a KV-load failure is a 500), shows
            # the instance is up: only silence and refusals take it out.
            self._account(pool, instance, "answered" if response.code < 400 else "error_status")
            self.record.decode_status = response.code
            return response
        assert last is not None
        raise last

    def _first_byte(self) -> None:
        self.record.decode_first_byte_seconds = self.clock.seconds() - self._decode_sent
        self.metrics.decode_first_byte_seconds.observe(self.record.decode_first_byte_seconds)

    async def _relay(self, response: IResponse) -> None:
        start_response(self.request, response)
        try:
            await self._track(
                relay_body(
                    self.request,
                    response,
                    self.clock,
                    self.limits.stream_idle_timeout,
                    on_first_byte=self._first_byte,
                )
            )
        except CancelledError:
            raise
        except Exception as error:
            if isinstance(error, StreamSilent) and not self.request.startedWriting:
                _reset_headers(self.request, self.request_id)
                raise gateway_timeout(
                    f"decode instance {self.record.decode} sent headers, then nothing: {error}",
                    "decode_timeout",
                ) from None
            log.error(
                "decode body for {request_id} broke off: {reason}",
                request_id=self.request_id,
                reason=_describe(error),
            )
            code = "decode_timeout" if isinstance(error, StreamSilent) else "decode_stream_broken"
            self.record.ended = "broken"
            await break_off(self.request, f"the decode stream broke off: {_describe(error)}", code)


def _passing(release: Callable[[Instance], None], instance: Instance) -> Callable[[T], T]:
    """A callback that releases an instance and passes the result on."""

    def passing(result: T) -> T:
        release(instance)
        return result

    return passing


class _Unreachable(Exception):
    """A backend could not be reached: nothing was sent, so another may be tried."""


def _query(request: Request) -> str:
    """The client's query string, passed on to both legs."""
    _, mark, query = request.uri.partition(b"?")
    return ("?" + query.decode("ascii", "replace")) if mark else ""


def _reset_headers(request: Request, request_id: str) -> None:
    request.responseHeaders = Headers({REQUEST_ID: [request_id.encode("ascii")]})


async def break_off(request: Request, message: str, code: str) -> None:
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
        request.write(b"data: " + error_body(message, "upstream_error", code) + b"\n\n")
    lost = request.notifyFinish()
    channel.loseConnection()
    with contextlib.suppress(Exception):
        await lost
