"""Where a capped completion's legs go: both slots taken at once, or the pool found full.

``place`` is what the fair queue (``slots``) calls for a waiting completion,
each time room may have come free: it chooses the decode instance (by the
pool's policy, among those under their caps), decides whether a prefill leg
pays (``decide``: the rules may ask what that decode instance holds), and
then chooses the prefill instance, all or nothing. A pool with no room is
seen before its policy is asked, so that a request tried and put back
leaves no trace in the policies' memory or their counters.
"""

from __future__ import annotations

from nixl_twisted.backends.pools import BackendPool, NoRoom
from nixl_twisted.backends.routing import Routing
from nixl_twisted.config import Disaggregation
from nixl_twisted.exchange.decide import FALLBACK, Mode, decide
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.sending import reserve
from nixl_twisted.exchange.slots import Placed
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError


def place(
    legs: Legs, rules: Disaggregation, completion: Completion, routing: Routing
) -> Placed | str:
    """Both legs' slots held (``Placed``), or the pool with no room (``"decode"``,
    ``"prefill"``); a ``ProxyError`` when a pool has no instance at all (503)."""
    backends, metrics, model = legs.backends, legs.metrics, routing.model
    if not _room(backends.decode, model):
        return "decode"
    if rules.always and not _room(backends.prefill, model):
        return "prefill"  # (two legs, whatever the decode instance: seen first)
    try:
        decode = reserve(backends.decode, metrics, routing, room=True)
    except NoRoom:  # (in panic: every instance down, those with room taken)
        return "decode"
    decision = decide(rules, completion, decode.instance, backends.prefill, legs.kv, routing.tokens)
    if decision.mode is not Mode.PD:
        return Placed(decode, decision)
    if not _room(backends.prefill, model):
        decode.release()
        return "prefill"
    try:
        prefill = reserve(backends.prefill, metrics, routing, room=True)
    except NoRoom:
        decode.release()
        return "prefill"
    except ProxyError:  # (no prefill instance at all for the model)
        if rules.fallback != "decode":
            decode.release()
            raise
        return Placed(decode, FALLBACK)
    return Placed(decode, decision, prefill)


def _room(pool: BackendPool, model: str | None) -> bool:
    """Whether some instance of ``pool`` that serves ``model`` takes a leg now.

    One with no room stands for every one it would be: the policy decides
    among those with room, and an instance down or draining is the policy's
    to pass over (a pool with none usable answers 503 there, not here).
    """
    for instance in pool.instances:
        serves = model is None or instance.serves(model)
        if serves and pool.has_room(instance) and pool.available(instance):
            return True
    return not any(pool.available(i) for i in pool.instances)
