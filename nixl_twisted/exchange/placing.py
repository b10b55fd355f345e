"""Where a completion's legs go, and whether it takes a prefill leg: decided here, once.

The decode instance is chosen and held first, by the pool's policy; the
decide rules then say whether a prefill leg pays (``decide``: they may ask
what that decode instance holds). With no cap anywhere that is all
(``place_now``): the prefill instance is chosen when its leg is sent. With
caps, the fair queue (``slots``) calls a placement for a waiting completion
each time room may have come free: a two-leg completion's prefill slot
first (``place_prefill``), its decode slot once prefill answered
(``place_decode``); ``place`` takes both at once, all or nothing (a
batch's part, a moved answer's continuation). A pool with no room is seen
before its policy is asked (``BackendPool.room_for``), so that a request
tried and put back leaves no trace in the policies' memory or their counters.

``place_prefill`` decides before any decode instance is held: the rules
read a decode instance only for the cached rule, and then it is *named*
(``named_decode``: the one holding most of the prompt, by the KV events),
never chosen by a policy (which would leave traces: the cursor,
cache-aware's memory, kv-aware's predictions, the counters). The decode
slot later goes to the named instance when it has room, else to the
policy's choice among those with room.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nixl_twisted.admission import Pool, RunAhead
from nixl_twisted.backends.capacity import has_room
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease, NoHealthyInstance, NoRoom
from nixl_twisted.backends.routing import Routing
from nixl_twisted.config import Disaggregation
from nixl_twisted.exchange.decide import FALLBACK, Decision, Mode, decide
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.sending import reserve, unavailable
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


@dataclass(frozen=True)
class Prefilling:
    """A two-leg completion's first slot: its prefill instance held, what was decided, the
    decode instance named for it (None: none was asked), and what gives back its place
    ahead of decode (``run_ahead``)."""

    prefill: Lease
    decision: Decision
    named: Instance | None
    behind: Callable[[], None]
    #: (No decode slot yet: ``place_decode`` takes it once prefill answered.)
    decode: None = None

    def release(self) -> None:
        """Its prefill slot back (if still held), and its place ahead of decode."""
        self.prefill.release()
        self.behind()


def place_now(
    legs: Legs,
    rules: Disaggregation,
    completion: Completion,
    routing: Routing,
    avoid: Sequence[Instance] = (),
    pinned: Instance | None = None,
) -> Placed:
    """No instance has a cap: the decode instance the policy chooses now, held, and whether
    prefill pays (a ``ProxyError``, 503, when no decode instance serves); ``avoid``: decode
    instances not to choose while another will do (a migration's); ``pinned``: the one
    that holds the conversation's KV (multi-turn reuse), while it is usable."""
    pool = legs.backends.decode
    if pinned is not None and pool.available(pinned) and not pinned.draining:
        decode = pool.lease(pinned, REUSE)
    else:
        decode = reserve(pool, legs.metrics, routing, avoid=avoid)
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


def place_prefill(
    legs: Legs,
    rules: Disaggregation,
    completion: Completion,
    routing: Routing,
    ahead: RunAhead,
    pinned: Instance | None = None,
) -> Prefilling | Placed | Pool:
    """Phase A: the prefill slot of a two-leg completion (``Prefilling``), or, decided decode
    alone, its decode slot (``Placed``), or the pool with no room; a two-leg completion
    whose model runs as far ahead of decode as it may (``ahead``) waits for decode. A
    ``ProxyError`` when no decode instance serves at all (503). ``pinned``: the decode
    instance that holds the conversation's KV (multi-turn reuse), named instead."""
    backends, metrics, model = legs.backends, legs.metrics, routing.model
    prefill = backends.prefill
    if rules.always and not prefill.room_for(model):
        return Pool.PREFILL  # (two legs, whatever is named: seen first)
    named = pinned or named_decode(legs, rules, completion, routing)
    decision = decide(rules, completion, named, prefill, legs.kv, routing.tokens)
    if decision.mode is not Mode.PD:
        return place_decode(legs, routing, decision, named)
    if not ahead.room(model):
        return Pool.DECODE  # (as far ahead of decode as it may run: decode is what is full)
    if not prefill.room_for(model):
        return Pool.PREFILL
    try:
        lease = reserve(prefill, metrics, routing, room=True)
    except NoRoom:
        return Pool.PREFILL
    except ProxyError:  # (no prefill instance at all for the model)
        if rules.fallback != "decode":
            raise
        return place_decode(legs, routing, FALLBACK, named)
    return Prefilling(lease, decision, named, ahead.hold(model))


def place_decode(
    legs: Legs, routing: Routing, decision: Decision, named: Instance | None, force: bool = False
) -> Placed | Pool:
    """Phase B: the decode slot of a prefilled completion, on the ``named`` instance when it
    has room, else the policy's choice among those with room; ``force``: whatever the caps
    (the lease guard)."""
    pool, metrics = legs.backends.decode, legs.metrics
    now = legs.clock.seconds()
    if named is not None and pool.available(named) and (force or has_room(named, now)):
        return Placed(pool.lease(named, NAMED), decision)
    if force:
        return Placed(reserve(pool, metrics, routing), decision)
    if not pool.room_for(routing.model):
        return Pool.DECODE
    try:
        return Placed(reserve(pool, metrics, routing, room=True), decision)
    except NoRoom:
        return Pool.DECODE


#: The routing decision of a decode slot taken on the instance named at phase A.
NAMED = "named"
#: ... on the instance that holds the conversation's KV (multi-turn reuse).
REUSE = "reuse"


def named_decode(
    legs: Legs, rules: Disaggregation, completion: Completion, routing: Routing
) -> Instance | None:
    """The decode instance the cached rule reads (None when no rule reads one): among
    those usable that serve the model, the one holding most of the prompt by the KV
    events (those with room first). Chooses nothing and leaves no trace. A ``ProxyError``
    (503) when no decode instance serves the model at all."""
    pool, model = legs.backends.decode, routing.model
    serving = [i for i in pool.instances if not i.draining and (model is None or i.serves(model))]
    if not serving:
        raise unavailable(NoHealthyInstance(pool.role, pool.retry_after(), model))
    tokens = routing.tokens
    if not rules.uncached or rules.always or tokens is None:
        return None
    now = legs.clock.seconds()
    usable = [i for i in serving if pool.available(i)] or serving

    def held(instance: Instance) -> tuple[bool, int]:
        cached = legs.kv.cached_tokens(instance, tokens, completion.salt)
        return has_room(instance, now), cached or 0

    return max(usable, key=held)


def _decided(
    legs: Legs, rules: Disaggregation, completion: Completion, routing: Routing, decode: Lease
) -> Decision:
    """Two legs or decode alone, on the decode instance held (the one place it is asked)."""
    prefill = legs.backends.prefill
    return decide(rules, completion, decode.instance, prefill, legs.kv, routing.tokens)
