"""One completion's phase machine: where it stands, what its client leaving does.

The phases are ``nixl_twisted.protocol.phases``'s, whose ``RULES`` table
says what a client disconnect does in each and which timer bounds it.
Before the client got a byte a timeout is a 504; after, the stream ends
with an error event (or the connection is closed short) and is never passed
off as complete. The legs themselves are ``prefill_leg``, ``decode_leg``
and ``two_legs`` (the order of both), which build on this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.backends.prompt_keys import routing_for
from nixl_twisted.exchange.decide import ALWAYS
from nixl_twisted.exchange.keepalive import KeepAlive, keep_alive
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.relay import break_off
from nixl_twisted.exchange.request import ExchangeRequest, query_of
from nixl_twisted.exchange.sending import PrefillRefused
from nixl_twisted.happened import Happened
from nixl_twisted.observe.access import record_of
from nixl_twisted.observe.spans import NO_LEG, NO_TRACE, LegTrace, RequestTrace
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import backend_request_headers
from nixl_twisted.protocol.phases import RULES, OnClientLeft, Phase

log = Logger()

T = TypeVar("T")


class PhasedExchange:
    """One completion's state and phases, its cancellation and its shutdown; the legs
    are its subclasses' (``two_legs.Exchange``)."""

    def __init__(
        self,
        legs: Legs,
        request: ExchangeRequest,
        completion: Completion,
        trace: RequestTrace = NO_TRACE,
        watch: Callable[[str], Callable[[bytes], bool]] | None = None,
    ) -> None:
        """Made by ``Serving``: ``legs`` the proxy's, with the configuration now in effect.

        Only instances serving ``completion.served`` take its legs, by that
        model's own policies and rules. ``watch``: given the decode instance,
        what watches its answer pass (the Responses API's ids).
        """
        config = legs.config
        self.legs = legs
        self.request = request
        self.completion = completion
        self.path = completion.path
        self.target = self.path + query_of(request)
        self.request_id = request_id = completion.request_id
        self.headers = backend_request_headers(
            request.requestHeaders, request_id, config.backend_api_key, keyed=config.keyed
        )
        self.backends = legs.backends
        self.timeouts = config.timeouts
        self.retries = config.retries
        self.clock = legs.clock
        self.metrics = legs.metrics
        self.record = record_of(request)
        self.record.request_id = request_id  # (a batch's part has no other place to get it)
        model = completion.served
        session = request.getHeader(b"x-session-id")
        needs = self.backends.needs(model)
        self.routing = routing_for(needs, config.policies.key_bytes, session, completion)
        self.watch = watch
        self.trace = trace
        #: The span of the leg attempt out now (a no-op when not traced).
        self._leg: LegTrace = NO_LEG
        #: The phases entered so far, and who waits for one not yet (``reached``).
        self._entered: set[Phase] = set()
        self._reached: dict[Phase, Happened] = {}
        self._enter(Phase.PREFILL)
        #: Why nobody waits for the answer any more (its client left), or None.
        self.client_gone: str | None = None
        #: The drain timeout ended: the proxy itself cuts this request.
        self.shutting_down = False
        #: Decode broke off: the proxy closed the client's connection, not the client.
        self.broke_off = False
        self._current: Deferred[Any] | None = None
        #: When a prefill leg is skipped (``nixl_twisted.exchange.decide``), as in effect now.
        self.rules = config.rules_for(model)
        self.render_timeout = config.kv_events.render_timeout
        #: Prefill is asked for the prompt's token ids, handed to decode (``token_ids``).
        self.asks_token_ids = config.token_ids_to_decode and completion.hands_token_ids
        self.decision = ALWAYS
        #: Its legs go only where there is room (some instance has a cap).
        self._capped = False
        self._decode_sent = 0.0
        self._params_at = 0.0
        #: Comment frames to the client until its first token (``--sse-keepalive``), or None.
        self.keepalive: KeepAlive | None = None

    def start(self) -> Deferred[None]:
        """Run the exchange; the Deferred is the one Klein cancels on disconnect."""
        outcome: Deferred[None] = Deferred(self._client_left)

        def settle(result: object) -> None:
            if not outcome.called:
                if isinstance(result, Failure):
                    outcome.errback(result)
                else:
                    outcome.callback(None)
            elif isinstance(result, Failure) and not result.check(
                CancelledError, ProxyError, PrefillRefused
            ):
                log.failure(
                    "error finishing {request_id} after its client left",
                    result,
                    request_id=self.request_id,
                )

        ensureDeferred(self._run()).addBoth(settle)
        return outcome

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.record.phase = phase
        self._entered.add(phase)
        if self._reached:  # (someone waits: a test, an operator)
            waited = self._reached.pop(phase, None)
            if waited is not None:
                waited.fire()

    def reached(self, phase: Phase | str) -> Deferred[None]:
        """Fires once the exchange has entered ``phase`` (for tests and operators)."""
        phase = Phase(phase)
        if phase in self._entered:
            return succeed(None)
        return self._reached.setdefault(phase, Happened()).wait()

    def shut_down(self) -> None:
        """Cut this request, saying so: a 503 if nothing was sent, else an error event."""
        self.shutting_down = True
        self.record.ended = "shutting_down"
        self._leg.fail("the proxy is shutting down: its drain timeout ended", self.phase.value)
        if self._current is not None:
            self._current.cancel()

    def _client_left(self, _: Deferred[None]) -> None:
        if self.shutting_down or self.broke_off:
            return  # the proxy closed the connection, after saying why
        # A batch's part the batch itself cancelled says why; else the client left.
        why = getattr(self.request, "ended_by", None)
        if why is None:
            why = f"client left during {self.phase.value}"
            self.metrics.client_disconnects.labels(self.phase.value).inc()
            log.info(
                "client left {request_id} during {phase}",
                request_id=self.request_id,
                phase=self.phase.value,
            )
        self.client_gone = why
        if RULES[self.phase].on_client_left is OnClientLeft.CANCEL and self._current is not None:
            self._leg.fail(why, self.phase.value)
            self._current.cancel()

    def _track(self, waiting: Deferred[T]) -> Deferred[T]:
        self._current = waiting
        return waiting

    async def _run(self) -> None:
        interval = self.timeouts.sse_keepalive
        self.keepalive = keep_alive(self.request, self.clock, interval, self.completion.stream)
        try:
            await self._legs()
        except CancelledError:
            if not self.shutting_down:
                raise
            message = "the proxy is shutting down: its drain timeout ended"
            if not self.request.startedWriting:
                raise ProxyError(ErrorCode.SHUTTING_DOWN, message, retry_after=1.0) from None
            await break_off(self.request, message, ErrorCode.SHUTTING_DOWN)
        finally:
            if self.keepalive is not None:
                self.keepalive.stop()

    async def _legs(self) -> None:
        """Both legs in order, then the relay (``two_legs.Exchange``)."""
        raise NotImplementedError
