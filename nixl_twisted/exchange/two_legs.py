"""One completion as two legs: its slots placed, the prefill leg, the decode leg, the relay.

The phase machine (``RULES``: what a client disconnect does in each phase)
is ``phased``; each leg is its own module (``prefill_leg``, ``decode_leg``);
this is their order, and the placing that comes before both.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.logger import Logger

from nixl_twisted.exchange.decode_leg import DecodeLeg
from nixl_twisted.exchange.fair_queue import Ticket
from nixl_twisted.exchange.placing import place
from nixl_twisted.exchange.prefill_leg import PrefillLeg
from nixl_twisted.exchange.relay import abandon
from nixl_twisted.exchange.sending import Asked, ByPolicy, reserve, send_leg
from nixl_twisted.exchange.slots import Placed
from nixl_twisted.exchange.tokens import wanted
from nixl_twisted.protocol.phases import Phase

log = Logger()


class Exchange(PrefillLeg, DecodeLeg):
    """Serves one completion: the prefill leg, the decode leg, the relay."""

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
