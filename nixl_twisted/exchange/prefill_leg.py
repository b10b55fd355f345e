"""A completion's prefill leg: sent with its retries, its ``kv_transfer_params`` handed back.

One attempt at one instance is ``prefill.prefill_attempt``; this is the leg
around it: the instance chosen (or the one placing held), the prompt's
token ids asked for and checked, the attempt timed and accounted for, and
the params the handoff yields, which the exchange (``two_legs``) makes the
decode body of.
"""

from __future__ import annotations

from twisted.internet.defer import TimeoutError, ensureDeferred

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease
from nixl_twisted.backends.routing import Routing
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.prefill import handed_over, prefill_attempt
from nixl_twisted.exchange.reusing import Reusing
from nixl_twisted.exchange.sending import (
    Asked,
    ByPolicy,
    PrefillRefused,
    account,
    send_leg,
    timed_out,
)
from nixl_twisted.exchange.served import Served
from nixl_twisted.observe.spans import AttemptTrace
from nixl_twisted.protocol import lowering, token_ids
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.handoff import read_prefill_answer
from nixl_twisted.protocol.headers import for_rank
from nixl_twisted.protocol.phases import Phase


class PrefillLeg:
    """Prefill for one completion, on the instance its pool's policy chooses (and retries)."""

    def __init__(
        self,
        legs: Legs,
        completion: Completion,
        routing: Routing,
        served: Served,
        own_ids: bool = False,
        reusing: Reusing | None = None,
        handle: lowering.JSONObject | None = None,
    ) -> None:
        """``own_ids``: the prompt's ids are asked for the proxy (a migration's continuation
        starts from them, never from what a failed decode said they were); ``handle``:
        decode's, claimed by ``reusing``, which its first attempt carries (once: vLLM reads
        wrong KV for a handle read twice)."""
        self.legs = legs
        self.completion = completion
        self.routing = routing
        self.served = served
        #: Prefill is asked for the prompt's token ids, handed to decode (``token_ids``).
        self.asks_token_ids = served.config.token_ids_to_decode and completion.hands_token_ids
        self._asks = self.asks_token_ids or own_ids
        #: The prompt's ids, as the prefill that served the leg answered them (None: not).
        self.prompt_ids: list[int] | None = None
        self.reusing = reusing
        self._handle = handle

    async def send(self, reserved: Lease | None) -> lowering.JSONObject:
        """Prefill's ``kv_transfer_params`` (its lowered body is let go once it answered);
        ``reserved``: the instance placing held for it (None: chosen now)."""
        legs, served, routing = self.legs, self.served, self.routing
        lowered = self.completion.prefill_bytes(self._asks)
        pool = legs.backends.prefill
        retries = served.config.retries.prefill
        prefill, params = await send_leg(
            pool,
            legs.metrics,
            lambda instance, span: self._attempt(instance, span, lowered),
            ByPolicy(pool, legs.metrics, routing, retries, served.room),
            Asked(served.trace, served.record, self._wanted),
            reserved,
        )
        served.record.prefill_route = prefill.decision
        served.record.prefill_matched_tokens = routing.matched.get("prefill")
        prefill.release()
        return params

    def _wanted(self) -> bool:
        """Nobody to answer and no blocks held yet: no more prefill attempts."""
        return not self.served.phases.client_gone

    async def _attempt(
        self, instance: Instance, span: AttemptTrace, lowered: bytes
    ) -> lowering.JSONObject:
        """One attempt; with the handle, and should its instance answer an error, once more
        there without it (a handle that could not be read: expired, or its blocks gone)."""
        handle, self._handle = self._handle, None
        if handle is None:
            return await self._sent(instance, span, lowered)
        reusing = self.reusing
        assert reusing is not None
        with_handle = self.completion.prefill_bytes(self._asks, handle)
        try:
            params = await self._sent(instance, span, with_handle, judged=False)
        except (ProxyError, PrefillRefused) as error:
            reusing.failed_on(instance.url, str(error), self.completion.request_id)
            if self.served.phases.client_gone:
                raise  # (nobody to answer: no second prefill)
            self.served.record.attempted("prefill", instance.url, "handle_failed", True)
            return await self._sent(instance, span, lowered)
        except BaseException:
            reusing.said("failed")
            raise
        reusing.read(instance.url)
        return params

    async def _sent(
        self, instance: Instance, span: AttemptTrace, lowered: bytes, judged: bool = True
    ) -> lowering.JSONObject:
        """``lowered`` sent to ``instance``; ``judged``: an error status counts against it."""
        legs, served = self.legs, self.served
        phases, record, clock = served.phases, served.record, legs.clock
        timeout = served.config.timeouts.prefill
        record.prefill = instance.url
        phases.attempting(span)
        phases.enter(Phase.PREFILL)
        started = clock.seconds()
        headers = for_rank(served.headers, instance.rank)
        answering = ensureDeferred(
            prefill_attempt(
                legs, instance, span, served.target, lowered, headers, self._answered, judged
            )
        )
        try:
            answer = await phases.track(answering.addTimeout(timeout, clock))
        except TimeoutError:
            account(legs.metrics, legs.backends.prefill, instance, "timeout", "prefill timed out")
            raise timed_out(instance, timeout) from None
        parsed = read_prefill_answer(answer, instance.url)
        request_id = self.completion.request_id
        params = handed_over(legs.metrics, instance, parsed, request_id, legs.allowed)
        account(legs.metrics, legs.backends.prefill, instance, "answered")
        record.prefill_seconds = clock.seconds() - started
        legs.metrics.child(legs.metrics.prefill_seconds, instance.url).observe(
            record.prefill_seconds
        )
        if self._asks:
            self.prompt_ids = token_ids.answered_prompt(parsed)
        return token_ids.handed(params, parsed) if self.asks_token_ids else params

    def _answered(self, status: int) -> None:
        # Prefill has answered: from here a disconnect must not stop decode.
        self.served.phases.enter(Phase.HANDOFF)
        self.served.record.prefill_status = status
