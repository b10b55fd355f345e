"""One completion as two legs: the prompt rendered if asked, its slots placed and decided,
the prefill leg, the decode leg and its relay; again elsewhere if decode fails mid-answer.

The exchange composes them and holds the order: each leg is an object of
its own (``prefill_leg.PrefillLeg``, ``decode_leg.DecodeLeg``) that takes
what it needs and returns what it yields; the phase machine (``RULES``:
what a client disconnect does in each phase) is ``phased.Phases``, which
both are handed. A decode answer that fails after its first byte may move
(``migration``): the exchange then places, prefills and decodes the
continuation the same way, into the same client answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred

from nixl_twisted.admission import Claim
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.prompt_keys import routing_for
from nixl_twisted.backends.routing import Routing
from nixl_twisted.exchange.decide import FALLBACK, Decision, Mode
from nixl_twisted.exchange.decode import DecodeRequest
from nixl_twisted.exchange.decode_leg import DecodeLeg, Watch
from nixl_twisted.exchange.keepalive import KeepAlive, keep_alive
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.migration import BATCH, Migrations, Moved
from nixl_twisted.exchange.phased import Phases
from nixl_twisted.exchange.placing import (
    Placed,
    Prefilling,
    place,
    place_now,
    place_prefill,
)
from nixl_twisted.exchange.prefill_leg import PrefillLeg
from nixl_twisted.exchange.ready import ready_slot
from nixl_twisted.exchange.request import ExchangeRequest, query_of
from nixl_twisted.exchange.reusing import Reusing, kept_answered
from nixl_twisted.exchange.sending import NoInstanceServed, PrefillRefused
from nixl_twisted.exchange.served import Served
from nixl_twisted.exchange.tokens import wanted
from nixl_twisted.observe.access import record_of
from nixl_twisted.observe.spans import NO_TRACE, RequestTrace
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import backend_request_headers
from nixl_twisted.protocol.phases import Phase


class Exchange:
    """Serves one completion: its legs in order, its phases, its shutdown."""

    def __init__(
        self,
        legs: Legs,
        request: ExchangeRequest,
        completion: Completion,
        trace: RequestTrace = NO_TRACE,
        watch: Watch | None = None,
        part: bool = False,
    ) -> None:
        """Made by ``Serving``: ``legs`` the proxy's, with the configuration now in effect.

        Only instances serving ``completion.served`` take its legs, by that
        model's own policies and rules. ``watch``: given the decode instance,
        what watches its answer pass (the Responses API's ids); ``part``: a
        batch's part (which never moves: the batch merges what it writes).
        """
        self.legs = legs
        self.config = config = legs.config
        self.request = request
        self.completion = completion
        self.trace = trace
        self.watch = watch
        self.part = part
        request_id = completion.request_id
        self.record = record = record_of(request)
        record.request_id = request_id  # (a batch's part has no other place to get it)
        self.phases = Phases(request, record, legs.metrics, request_id)
        self.headers = backend_request_headers(
            request.requestHeaders,
            request_id,
            config.backend_api_key,
            keyed=config.keyed,
            forwarded=config.forward_headers,
        )
        model = completion.served
        session = request.getHeader(b"x-session-id")
        needs = legs.backends.needs(model)
        self.routing = routing_for(needs, config.policies.key_bytes, session, completion)
        #: When a prefill leg is skipped (``nixl_twisted.exchange.decide``), as in effect now.
        self.rules = config.rules_for(model)
        #: Where its answer moves should its decode instance fail mid-answer (None: off).
        self.moves: Migrations | None = None
        #: What the legs placed last were sent with (a moved answer's end is told through it).
        self._served: Served | None = None
        #: Multi-turn reuse (None: off, or a batch's part, which reads no handle).
        self.reusing: Reusing | None = None
        if config.reuse.enabled and not part:
            self.reusing = Reusing(legs.handles, completion, legs.metrics, record, legs.allowed)
        rules = config.migrations
        if rules.limit:
            refused = BATCH if part else None
            made = Migrations(completion, rules, legs.clock, legs.metrics, record, trace, refused)
            self.moves = made

    @property
    def phase(self) -> Phase:
        return self.phases.phase

    def start(self) -> Deferred[None]:
        """Run the exchange; the Deferred is the one Klein cancels on disconnect."""
        return self.phases.start(self._run)

    def reached(self, phase: Phase | str) -> Deferred[None]:
        """Fires once the exchange has entered ``phase`` (for tests and operators)."""
        return self.phases.reached(phase)

    def shut_down(self) -> None:
        """Cut this request, saying so: a 503 if nothing was sent, else an error event."""
        self.phases.shut_down()

    async def _run(self) -> None:
        interval = self.config.timeouts.sse_keepalive
        keepalive = keep_alive(self.request, self.legs.clock, interval, self.completion.stream)
        try:
            await self._legs(keepalive)
        except CancelledError:
            if not self.phases.shutting_down:
                raise
            await self.phases.cut_short()
        finally:
            if keepalive is not None:
                keepalive.stop()

    async def _legs(self, keepalive: KeepAlive | None) -> None:
        """The legs, and again elsewhere while the answer moves: the one place that decides
        where a moved answer goes (each leg's own retries are ``send_leg``'s)."""
        routing = await self._rendered()
        if self.reusing is not None:  # (the handle its prompt extends, and where it is)
            found = self.reusing.find(routing.tokens or self.completion.token_ids, self.legs)
            await self.phases.track(ensureDeferred(found))
        moved = await self._pair(routing, self.completion, keepalive)
        avoid: list[Instance] = []
        while moved is not None:  # (its answer moves: the continuation, the same way)
            if moved.failed is not None:
                avoid = [*avoid, moved.failed]
            self.phases.enter(Phase.PREFILL)
            try:
                moved = await self._pair(routing, moved.continuation, keepalive, avoid)
            except (ProxyError, PrefillRefused):
                # The continuation failed before its answer came: once more (elsewhere, while
                # another decode instance will do), or the end its break says.
                assert self.moves is not None
                again = self.moves.again()
                if again is None:
                    raise  # (the end of an answer that could move no more: its error)
                if not isinstance(again, Moved):
                    assert self._served is not None
                    await again.end(self._served)
                    return
                moved = again

    async def _pair(
        self,
        routing: Routing,
        completion: Completion,
        keepalive: KeepAlive | None,
        avoid: list[Instance] | None = None,
    ) -> Moved | None:
        """``completion``'s legs, placed, handed off and relayed; what continues its answer
        on another decode instance (None: it ended)."""
        first = avoid is None
        served, placed = await self._placed(routing, completion, avoid or (), first)
        try:
            decision, handed_at, body = await self._handoff(
                routing, completion, served, placed, first
            )
            if isinstance(placed, Prefilling):
                phases, record = self.phases, self.record
                placed = await ready_slot(
                    self.legs, phases, record, routing, completion, placed, decision, handed_at
                )
        except BaseException:
            placed.release()  # (until send_leg takes them over, the leases are ours to give back)
            raise
        timeout = self.config.timeouts.decode
        sent = DecodeRequest(served.target, body, self.headers, timeout, True, True)
        decode = DecodeLeg(
            self.legs,
            completion,
            routing,
            served,
            keepalive,
            self.watch,
            self.moves,
            self._collects,
        )
        assert placed.decode is not None
        if served.room and self.legs.slots is not None:  # (its slot's end measured)
            measured = partial(self.legs.slots.measured, completion.served, self.record)
            placed.decode.also(lambda: measured(decision.mode is Mode.PD))
        moved = await decode.send(sent, placed.decode, decision, handed_at)
        kept_answered(self.legs, self.reusing, decode.answered)
        return moved

    @property
    def _collects(self) -> bool:
        """Decode's answer is asked for its ids, kept with its handle for the next turn."""
        return self.reusing is not None and self.reusing.keeps

    async def _rendered(self) -> Routing:
        """The routing, with the prompt's token ids when a policy, the cached rule or
        multi-turn reuse reads them (rendered by vLLM: ``tokens``)."""
        legs, routing = self.legs, self.routing
        reused = self._collects and self.completion.token_ids is None  # (ids are their own)
        renders = wanted(legs.backends, self.rules, routing.model, bool(legs.kv.streams), reused)
        if renders is None:
            return routing
        timeout = self.config.kv_events.render_timeout
        rendering = legs.renderer.routed(renders, routing, self.completion, self.headers, timeout)
        return await self.phases.track(ensureDeferred(rendering))

    async def _placed(
        self, routing: Routing, c: Completion, avoid: Sequence[Instance], first: bool
    ) -> tuple[Served, Placed | Prefilling]:
        """The decode instance held (and, with caps, the prefill instance too), and whether
        prefill pays: at once, or once the fair queue lets it go (``Phase.QUEUED``); with
        caps, a two-leg completion's prefill slot alone (``Prefilling``: its decode slot is
        taken once prefill answered, ``ready.ready_slot``); ``avoid``: decode instances a
        moved answer failed on; ``first``: not a moved answer's continuation."""
        legs, phases, record = self.legs, self.phases, self.record
        slots, backends = legs.slots, legs.backends
        room = slots is not None and (backends.decode.capped or backends.prefill.capped)
        target = c.path + query_of(self.request)
        served = Served(
            self.request, target, self.headers, self.config, self.trace, record, phases, room
        )
        self._served = served
        # (a conversation's handle's decode instance, for its first legs)
        pinned = self.reusing.pinned if first and self.reusing is not None else None
        if slots is None or not room:
            # Decode first: the rules may ask what its instance holds, and a
            # request with no decode instance to go to is refused before prefill runs.
            return served, place_now(legs, self.rules, c, routing, avoid, pinned)
        phases.enter(Phase.QUEUED)
        ticket = Claim.of(c)
        record.prompt_estimate = ticket.prompt
        if c is not self.completion:  # (a moved answer's rest: never refused for its target)
            ticket = replace(ticket, target=None)
        elif ticket.target is not None:
            prediction = slots.predicted(ticket)
            if prediction is not None:
                record.ttft_predicted_seconds = prediction.seconds
                record.ttft_predicted_base_seconds = prediction.base
        taken: Placed | Prefilling | Deferred[Placed | Prefilling]
        if first and not self.part:  # (a batch's part and a continuation: both at once)
            rules = self.rules
            taken = slots.take_prefill(
                ticket, lambda ahead: place_prefill(legs, rules, c, routing, ahead, pinned)
            )
        else:
            taken = slots.take(ticket, lambda: place(legs, self.rules, c, routing, avoid))
        if isinstance(taken, Deferred):
            clock = legs.clock
            since = clock.seconds()
            try:
                taken = await phases.track(taken)
            finally:
                waited = clock.seconds() - since
                record.queued_seconds = (record.queued_seconds or 0.0) + waited
        phases.enter(Phase.PREFILL)
        return served, taken

    async def _handoff(
        self,
        routing: Routing,
        c: Completion,
        served: Served,
        placed: Placed | Prefilling,
        first: bool,
    ) -> tuple[Decision, float, bytes]:
        """The prefill leg if placing decided it pays (decode alone when no prefill instance
        serves and the fallback is on), and what the decode leg sends after it; ``first``:
        not a moved answer's continuation (counted once per completion)."""
        decision = placed.decision
        assert decision is not None  # (placing decides for every completion)
        handed_at, params = 0.0, {}
        moves, reusing = self.moves, self.reusing
        own_ids = first and moves is not None and moves.tracked
        handle = None
        if first and reusing is not None:
            pd = decision.mode is Mode.PD
            handle = await self.phases.track(ensureDeferred(reusing.claimed(pd)))
        prefill = PrefillLeg(self.legs, c, routing, served, own_ids, reusing, handle)
        try:
            if decision.mode is Mode.PD:
                try:
                    params = await prefill.send(placed.prefill)
                    handed_at = self.legs.clock.seconds()
                except NoInstanceServed:
                    if self.rules.fallback != "decode":
                        raise
                    decision = FALLBACK
        finally:
            if first:
                self._decided(decision)
            if handle is not None and reusing is not None:  # (claimed, and never read: lost)
                reusing.said("failed")
        if moves is not None and first:
            moves.handed(params, prefill.prompt_ids)
        tracked = moves is not None and moves.tracked
        if decision.mode is Mode.PD:
            self.phases.enter(Phase.HANDOFF)
            return decision, handed_at, c.decode_bytes(params, tracked or self._collects)
        if self.phases.client_gone:  # (left while prefill's last error was being read)
            raise CancelledError()
        self.phases.enter(Phase.DECODE)
        return decision, handed_at, c.decode_only_bytes(tracked)

    def _decided(self, decision: Decision) -> None:
        mode, reason = decision.mode.value, decision.reason.value
        self.record.mode, self.record.decided_by = mode, reason
        metrics = self.legs.metrics
        metrics.child(metrics.disaggregation_decisions, mode, reason).inc()
