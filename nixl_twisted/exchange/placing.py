"""Where a completion's legs go, and whether it takes a prefill leg: decided here, once.

The decode instance is chosen and held first, by the pool's policy; the
decide rules then say whether a prefill leg pays (``decide``: they may ask
what that decode instance holds). With no cap anywhere that is all
(``place_now``): the prefill instance is chosen when its leg is sent. With
caps, ``place`` is what the fair queue (``slots``) calls for a waiting
completion each time room may have come free: both slots are taken at
once, the prefill instance too, all or nothing. A pool with no room is seen
before its policy is asked (``BackendPool.room_for``), so that a request
tried and put back leaves no trace in the policies' memory or their counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nixl_twisted.admission import Pool
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease, NoRoom
from nixl_twisted.backends.routing import Routing
from nixl_twisted.config import Disaggregation
from nixl_twisted.exchange.decide import FALLBACK, Decision, Mode, decide
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.sending import reserve
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError


@dataclass(frozen=True)
class Placed:
    """A completion's slots: its decode instance held, what was decided, and its prefill
    instance held when it takes a prefill leg (None: chosen when the leg is sent)."""

    decode: Lease
    decision: Decision | None = None
    prefill: Lease | None = None

    def release(self) -> None:
        """Give back what was never used (the request ended before its legs took them)."""
        self.decode.release()
        if self.prefill is not None:
            self.prefill.release()


def place_now(
    legs: Legs,
    rules: Disaggregation,
    completion: Completion,
    routing: Routing,
    avoid: Sequence[Instance] = (),
) -> Placed:
    """No instance has a cap: the decode instance the policy chooses now, held, and whether
    prefill pays (a ``ProxyError``, 503, when no decode instance serves); ``avoid``: decode
    instances not to choose while another will do (a migration's)."""
    decode = reserve(legs.backends.decode, legs.metrics, routing, avoid=avoid)
    try:
        return Placed(decode, _decided(legs, rules, completion, routing, decode))
    except BaseException:
        decode.release()
        raise


def place(
    legs: Legs,
    rules: Disaggregation,
    completion: Completion,
    routing: Routing,
    avoid: Sequence[Instance] = (),
) -> Placed | Pool:
    """Both legs' slots held (``Placed``), or the pool with no room (``Pool``); a
    ``ProxyError`` when a pool has no instance at all (503)."""
    backends, metrics, model = legs.backends, legs.metrics, routing.model
    if not backends.decode.room_for(model):
        return Pool.DECODE
    if rules.always and not backends.prefill.room_for(model):
        return Pool.PREFILL  # (two legs, whatever the decode instance: seen first)
    try:
        decode = reserve(backends.decode, metrics, routing, room=True, avoid=avoid)
    except NoRoom:  # (in panic: every instance down, those with room taken)
        return Pool.DECODE
    decision = _decided(legs, rules, completion, routing, decode)
    if decision.mode is not Mode.PD:
        return Placed(decode, decision)
    if not backends.prefill.room_for(model):
        decode.release()
        return Pool.PREFILL
    try:
        prefill = reserve(backends.prefill, metrics, routing, room=True)
    except NoRoom:
        decode.release()
        return Pool.PREFILL
    except ProxyError:  # (no prefill instance at all for the model)
        if rules.fallback != "decode":
            decode.release()
            raise
        return Placed(decode, FALLBACK)
    return Placed(decode, decision, prefill)


def _decided(
    legs: Legs, rules: Disaggregation, completion: Completion, routing: Routing, decode: Lease
) -> Decision:
    """Two legs or decode alone, on the decode instance held (the one place it is asked)."""
    prefill = legs.backends.prefill
    return decide(rules, completion, decode.instance, prefill, legs.kv, routing.tokens)
