"""How many legs an instance takes at once: its cap, this process's share of it, and room now.

An instance's cap is its own (``URL#max-in-flight=N``), else its model's
(``[models.NAME] prefill-max-in-flight``), else its pool's
(``--prefill-max-in-flight``); 0 is none. Under ``--workers N`` the cap is
the whole proxy's: each worker takes ``cap // N`` slots and the remainder
goes to the workers after one that the instance's URL picks, so that the
shares add up to the cap exactly and different instances give their
remainder to different workers. vLLM answering 503 (its engine's queue is
full) makes an instance count as full for ``COOL`` seconds.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from nixl_twisted.backends.instances import Instance

#: Seconds an instance that answered 503 counts as full: no leg goes to it meanwhile.
COOL = 1.0


@dataclass(frozen=True)
class Caps:
    """A pool's caps (0: none), and which share of them is this process's."""

    default: int = 0
    #: A model's own cap, for the instances ``[models.NAME]`` lists under it.
    by_model: Mapping[str, int] = field(default_factory=dict)
    #: This process among the proxy's workers (0 of 1 alone).
    worker: int = 0
    workers: int = 1

    def of(self, instance: Instance) -> int:
        """The legs ``instance`` takes at once, the whole proxy's (0: no cap)."""
        if instance.own_cap is not None:
            return instance.own_cap
        for model in sorted(instance.named):
            if model in self.by_model:
                return self.by_model[model]
        return self.default

    def slots(self, instance: Instance) -> int | None:
        """The legs this process may hold on ``instance`` at once (None: no cap)."""
        cap = self.of(instance)
        return None if cap == 0 else share(cap, instance.url, self.worker, self.workers)


def share(cap: int, url: str, worker: int, workers: int) -> int:
    """Worker ``worker``'s share of ``cap`` among ``workers``: the shares add up to ``cap``."""
    whole, rest = divmod(cap, workers)
    first = zlib.crc32(url.encode("utf-8")) % workers
    return whole + (1 if (worker - first) % workers < rest else 0)


def has_room(instance: Instance, now: float) -> bool:
    """Whether a leg may go to ``instance`` now: under its share of its cap, and not cooling
    after a 503."""
    if instance.full_until > now:
        return False
    return instance.slots is None or instance.in_flight < instance.slots
