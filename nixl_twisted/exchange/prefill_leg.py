"""The exchange's prefill leg: decided, sent with its retries, its ``kv_transfer_params`` handed on.

One attempt at one instance is ``prefill.prefill_attempt``; this is the leg
around it: whether prefill pays at all (``decide``), the fallback to decode
alone when no prefill instance serves, the prompt's token ids asked for and
checked, and the decode body the handoff yields.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, TimeoutError, ensureDeferred

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease
from nixl_twisted.exchange.decide import ALWAYS, FALLBACK, Decision, Mode, decide
from nixl_twisted.exchange.legs import DecodeRequest
from nixl_twisted.exchange.phased import PhasedExchange
from nixl_twisted.exchange.prefill import handed_over, prefill_attempt
from nixl_twisted.exchange.sending import (
    Asked,
    ByPolicy,
    NoInstanceServed,
    account,
    send_leg,
    timed_out,
)
from nixl_twisted.exchange.slots import Placed
from nixl_twisted.observe.spans import LegTrace
from nixl_twisted.protocol import lowering, token_ids
from nixl_twisted.protocol.handoff import read_prefill_answer
from nixl_twisted.protocol.headers import for_rank
from nixl_twisted.protocol.phases import Phase


class PrefillLeg(PhasedExchange):
    """What a completion does up to its handoff: decide, prefill, the decode body."""

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
        parsed = read_prefill_answer(answer, instance.url)
        params = handed_over(self.metrics, instance, parsed, self.request_id)
        account(self.metrics, self.backends.prefill, instance, "answered")
        self.record.prefill_seconds = self.clock.seconds() - started
        self.metrics.child(self.metrics.prefill_seconds, instance.url).observe(
            self.record.prefill_seconds
        )
        return token_ids.handed(params, parsed) if self.asks_token_ids else params

    def _prefill_answered(self, status: int) -> None:
        # Prefill has answered: from here a disconnect must not stop decode.
        self._enter(Phase.HANDOFF)
        self.record.prefill_status = status
