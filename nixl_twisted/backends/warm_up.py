"""Warm-up: an instance that joined lately takes ``cache-aware``'s and ``kv-aware``'s misses.

An instance that joins a pool (added by the admin API, found by discovery,
or up again after down) holds no prefix: the cache-aware policies keep
sending the prompts that follow a prefix to the old instances, and it sits
idle while they queue. For ``--warm-up`` seconds after it joined
(``Instance.warm_until``), a miss (a prompt no instance is worth following
for) goes to it instead, while it holds fewer legs in flight than the
other instances' mean; what it is sent then, later turns follow.
``docs/routing.md`` ("Warm-up") says the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nixl_twisted.backends.health import State
from nixl_twisted.backends.instances import Instance

#: The decision a miss placed by warm-up carries.
WARM_UP = "warm_up"


def warming(instance: Any, now: float) -> bool:
    """Whether ``instance`` joined within its pool's ``--warm-up``."""
    return bool(getattr(instance, "warm_until", 0.0) > now)


def warm_miss(pool: Any, candidates: Sequence[Any]) -> Any | None:
    """The warming candidate a miss goes to, or None (none warming, or each as busy as the rest).

    The one with the fewest legs in flight among those under the others'
    mean (in the pool's rotation on a tie). When every candidate is warming
    (a proxy just started) there are no others: nobody is preferred.
    """
    clock = getattr(pool, "clock", None)
    if clock is None:
        return None
    now = clock.seconds()
    new = [c for c in candidates if warming(c, now)]
    others = [c for c in candidates if not warming(c, now)]
    if not new or not others:
        return None
    mean = sum(c.in_flight for c in others) / len(others)
    below = [c for c in new if c.in_flight < mean]
    if not below:
        return None
    fewest = min(c.in_flight for c in below)
    return pool.round_robin([c for c in below if c.in_flight == fewest])


def joined(instance: Instance, was: State, founding: set[str], until: float) -> None:
    """``instance`` turned from ``was`` to its state now: up now and not before, new or up
    again, it warms up ``until`` then; but not one of the instances the proxy started with
    (``founding``), checked for the first time: they all start cold together."""
    if was is State.UP or instance.state is not State.UP:
        return
    if was is State.PENDING and instance.url in founding:
        founding.discard(instance.url)
        return
    instance.warm_until = until
