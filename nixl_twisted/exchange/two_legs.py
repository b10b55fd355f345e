"""One completion as a small state machine: the prefill leg, the decode leg, the relay.

It moves through the phases of ``nixl_twisted.protocol.phases``, whose ``RULES``
table says what a client disconnect does in each and which timer bounds it.
Before the client got a byte a timeout is a 504; after, the stream ends
with an error event (or the connection is closed short) and is never passed
off as complete.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from twisted.internet.defer import CancelledError, Deferred, TimeoutError, ensureDeferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease
from nixl_twisted.backends.prompt_keys import routing_for
from nixl_twisted.exchange.decide import ALWAYS, FALLBACK, Decision, Mode, decide
from nixl_twisted.exchange.fair_queue import Ticket
from nixl_twisted.exchange.keepalive import KeepAlive, keep_alive
from nixl_twisted.exchange.legs import DecodeRequest, Legs, note_handoff
from nixl_twisted.exchange.placing import place
from nixl_twisted.exchange.prefill import handed_over, prefill_attempt
from nixl_twisted.exchange.relay import (
    StreamSilent,
    abandon,
    break_off,
    relay_body,
    start_response,
)
from nixl_twisted.exchange.request import ExchangeRequest, query_of
from nixl_twisted.exchange.sending import (
    Asked,
    ByPolicy,
    NoInstanceServed,
    PrefillRefused,
    account,
    reason_of,
    reserve,
    send_leg,
    timed_out,
)
from nixl_twisted.exchange.slots import Placed
from nixl_twisted.exchange.tokens import wanted
from nixl_twisted.happened import Happened
from nixl_twisted.observe.access import record_of
from nixl_twisted.observe.spans import NO_LEG, NO_TRACE, LegTrace, RequestTrace
from nixl_twisted.protocol import lowering, token_ids
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import REQUEST_ID, backend_request_headers, for_rank
from nixl_twisted.protocol.phases import RULES, OnClientLeft, Phase
from nixl_twisted.protocol.usage import UsageChunkHidden, read_usage

log = Logger()

T = TypeVar("T")


class Exchange:
    """Serves one completion: the prefill leg, the decode leg, the relay."""

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
        policies = {pool.policy_for(model)[0] for pool in self.backends.pools()}
        session = request.getHeader(b"x-session-id")
        self.routing = routing_for(policies, config.policies.key_bytes, session, completion)
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
        renders = wanted(self.backends, self.rules, self.routing.model, bool(self.legs.kv.streams))
        if renders is not None:  # (kv-aware, or the cached rule: the prompt's token ids)
            renderer, timeout = self.legs.renderer, self.render_timeout
            rendering = renderer.routed(
                renders, self.routing, self.completion, self.headers, timeout
            )
            self.routing = await self._track(ensureDeferred(rendering))
        placed = await self._placed()
        try:
            completed = await self._before_decode(placed)
        except BaseException:
            placed.release()  # (until send_leg takes them over, the leases are ours to give back)
            raise
        reserved = placed.decode
        pool = self.backends.decode
        decode, response = await send_leg(
            pool,
            self.metrics,
            lambda instance, leg: self._decode(instance, leg, completed),
            ByPolicy(pool, self.metrics, self.routing, self.retries.decode, self._capped),
            Asked(self.trace, self.record, self._decode_wanted),
            reserved,
        )
        self.record.decode_route = decode.decision
        self.record.decode_matched_tokens = self.routing.matched.get("decode")
        try:
            if self.client_gone:
                self._leg.fail(f"{self.client_gone}: decode's answer abandoned", self.phase.value)
                abandon(response)
                log.info(
                    "decode for {request_id} abandoned, unread: {why}",
                    request_id=self.request_id,
                    why=self.client_gone,
                )
                return
            self._enter(Phase.RELAY)
            await self._relay(response, decode)
        finally:
            decode.release()

    async def _placed(self) -> Placed:
        """The decode instance held (and, with caps, the prefill instance too): at once, or
        once the fair queue lets this request go (``Phase.QUEUED``)."""
        slots, backends = self.legs.slots, self.backends
        self._capped = slots is not None and (backends.decode.capped or backends.prefill.capped)
        if slots is None or not self._capped:
            # Decode first: the rules may ask what its instance holds, and a
            # request with no decode instance to go to is refused before prefill runs.
            return Placed(reserve(self.backends.decode, self.metrics, self.routing))
        self._enter(Phase.QUEUED)
        c = self.completion
        taken = slots.take(Ticket(c.tenant, c.weight, c.priority, c.served), self._place)
        if isinstance(taken, Deferred):
            since = self.clock.seconds()
            try:
                taken = await self._track(taken)
            finally:
                self.record.queued_seconds = self.clock.seconds() - since
        self._enter(Phase.PREFILL)
        return taken

    def _place(self) -> Placed | str:
        return place(self.legs, self.rules, self.completion, self.routing)

    async def _before_decode(self, placed: Placed) -> DecodeRequest:
        """Decide, run the prefill leg if it pays, and say what the decode leg sends."""
        decision = ALWAYS
        params: lowering.JSONObject = {}
        try:
            decision = placed.decision or decide(
                self.rules,
                self.completion,
                placed.decode.instance,
                self.backends.prefill,
                self.legs.kv,
                self.routing.tokens,
            )
            if decision.mode is Mode.PD:
                try:
                    params = await self._prefill_leg(placed.prefill)
                except NoInstanceServed:
                    if self.rules.fallback != "decode":
                        raise
                    decision = FALLBACK
        finally:
            self._decided(decision)
        if decision.mode is Mode.PD:
            self._enter(Phase.HANDOFF)
            body = self.completion.decode_bytes(params)
        else:
            if self.client_gone:  # (left while prefill's last error was being read)
                raise CancelledError()
            self._enter(Phase.DECODE)
            body = self.completion.decode_only_bytes()
        return DecodeRequest(self.target, body, self.headers, self.timeouts.decode, True)

    def _prefill_wanted(self) -> bool:
        """Nobody to answer and no blocks held yet: no more prefill attempts."""
        return not self.client_gone

    def _decode_wanted(self) -> bool:
        """A decode-only request has no prefill blocks to free: nobody to answer, no retry."""
        return not (self.client_gone and self.decision.mode is Mode.DECODE_ONLY)

    def _decided(self, decision: Decision) -> None:
        self.decision = decision
        mode, reason = decision.mode.value, decision.reason.value
        self.record.mode, self.record.decided_by = mode, reason
        self.metrics.child(self.metrics.disaggregation_decisions, mode, reason).inc()

    async def _prefill_leg(self, reserved: Lease | None) -> lowering.JSONObject:
        """Prefill's ``kv_transfer_params`` (its lowered body is let go once it answered);
        ``reserved``: the instance the fair queue placed it on (None: chosen now)."""
        lowered = self.completion.prefill_bytes(self.asks_token_ids)
        pool = self.backends.prefill
        prefill, params = await send_leg(
            pool,
            self.metrics,
            lambda instance, leg: self._prefill(instance, leg, lowered),
            ByPolicy(pool, self.metrics, self.routing, self.retries.prefill, self._capped),
            Asked(self.trace, self.record, self._prefill_wanted),
            reserved,
        )
        self.record.prefill_route = prefill.decision
        self.record.prefill_matched_tokens = self.routing.matched.get("prefill")
        self._params_at = self.clock.seconds()
        prefill.release()
        return params

    async def _prefill(
        self, instance: Instance, leg: LegTrace, lowered: bytes
    ) -> lowering.JSONObject:
        self.record.prefill = instance.url
        self._leg = leg
        self._enter(Phase.PREFILL)
        started = self.clock.seconds()
        headers = for_rank(self.headers, instance.rank)
        answering = ensureDeferred(
            prefill_attempt(
                self.legs, instance, leg, self.target, lowered, headers, self._prefill_answered
            )
        )
        try:
            answer = await self._track(answering.addTimeout(self.timeouts.prefill, self.clock))
        except TimeoutError:
            account(self.metrics, self.backends.prefill, instance, "timeout", "prefill timed out")
            raise timed_out(instance, self.timeouts.prefill) from None
        params = handed_over(self.metrics, instance, answer, self.request_id)
        account(self.metrics, self.backends.prefill, instance, "answered")
        self.record.prefill_seconds = self.clock.seconds() - started
        self.metrics.child(self.metrics.prefill_seconds, instance.url).observe(
            self.record.prefill_seconds
        )
        return token_ids.handed(params, answer) if self.asks_token_ids else params

    def _prefill_answered(self, status: int) -> None:
        # Prefill has answered: from here a disconnect must not stop decode.
        self._enter(Phase.HANDOFF)
        self.record.prefill_status = status

    async def _decode(
        self, instance: Instance, leg: LegTrace, completed: DecodeRequest
    ) -> IResponse:
        self._leg = leg
        self._decode_sent = self.clock.seconds()
        if self.decision.mode is Mode.DECODE_ONLY:  # (computed there on purpose: not an alarm)
            token_ids = self.completion.token_ids
            instance.alone_tokens += len(token_ids) if token_ids else self.completion.estimate or 0
        response = await self.legs.decode_attempt(
            instance, leg, completed, self.record, self._track
        )
        if self.decision.mode is Mode.PD:
            self._handoff_gap(instance)
        self.record.decode_status = response.code
        return response

    def _handoff_gap(self, instance: Instance) -> None:
        gap = self._decode_sent - self._params_at
        self.record.handoff_gap_seconds = gap
        note_handoff(
            self.metrics, gap, self.timeouts.handoff_warning, self.request_id, instance.url
        )

    def _first_byte(self, instance: Instance) -> None:
        if self.keepalive is not None:
            self.keepalive.stop()
        waited = self.clock.seconds() - self._decode_sent
        self.record.decode_first_byte_seconds = waited
        self.metrics.child(self.metrics.decode_first_byte_seconds, instance.url).observe(waited)

    async def _relay(self, response: IResponse, decode: Lease) -> None:
        keepalive = self.keepalive
        if keepalive is not None and keepalive.in_band(response):
            # The client has its 200 already: decode's error answer goes in-band.
            idle = self.timeouts.stream_idle
            await self._track(keepalive.answer_in_band(response, idle))
            return
        if keepalive is None or not keepalive.opened:
            start_response(self.request, response)
        try:
            watching = self.watch(decode.instance.url) if self.watch is not None else None
            await self._track(
                relay_body(
                    self.request,
                    response,
                    self.clock,
                    self.timeouts.stream_idle,
                    partial(self._first_byte, decode.instance),
                    watching,
                    self._used,
                    UsageChunkHidden() if self.completion.hides_usage else None,
                )
            )
        except CancelledError:
            raise
        except Exception as error:
            silent = isinstance(error, StreamSilent)
            self._leg.fail(str(error) if silent else f"broke off: {reason_of(error)}", "relay")
            if silent and not self.request.startedWriting:
                self.request.responseHeaders = Headers({REQUEST_ID: [self.request_id.encode()]})
                url = decode.instance.url
                raise ProxyError(
                    ErrorCode.DECODE_TIMEOUT,
                    "the decode instance sent headers, then nothing",
                    detail=f"decode instance {url} sent headers, then nothing: {error}",
                ) from None
            log.error(
                "decode body for {request_id} broke off: {reason}",
                request_id=self.request_id,
                reason=reason_of(error),
            )
            self.record.ended = "broken"
            said = (
                f"decode went silent mid-stream: {error}"
                if silent
                else "decode closed the stream early"
            )
            self.record.error = said
            # The client is told what happened; the detail is in the log line above.
            self.broke_off = True
            await break_off(
                self.request,
                said,
                ErrorCode.DECODE_TIMEOUT if silent else ErrorCode.DECODE_STREAM_BROKEN,
            )

    def _used(self, tail: bytes) -> None:
        """What decode's answer reported using, from its last chunks."""
        self.record.usage = read_usage(tail)
