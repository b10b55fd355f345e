"""``RunAhead``: how far prefill runs ahead of decode, per model, and the KV lease's guard.

A two-leg completion takes its prefill slot first and its decode slot once
prefill answered (``slots``). Between the two its prompt's KV waits on the
prefill instance, under vLLM's lease (``kv_lease_duration``): so each model
holds at most ``limit`` requests *ahead* (holding a prefill slot, or
prefilled and ready for decode). The limit is ``--prefill-run-ahead`` when
set, else the sum of the model's decode caps (one prefill per decode slot:
never more KV parked on prefill than decode could take at once) until the
rates are measured, then what keeps decode fed (``needed``): more when
prefill takes as long as a decode slot's turn (one per slot is too few),
fewer when prefill is short (each request ready ahead waits in the ready
lane, where fairness no longer orders it: a long ready lane is first-token
time spent for nothing);
shared through Redis, the limit is the fleet's, held against this
replica's requests ahead and the others' as last heard (``others``:
``fleet_ahead``); while Redis is away, this replica's static share of it
(``share``). With no cap on some decode instance of the model, a ready
request never waits: no limit.

A ready request that waited until its lease is near its end (``guard_at``)
is sent to decode over its cap: inside vLLM's queue its lease is renewed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from nixl_twisted.backends.pools import BackendPool

#: Seconds kept before a KV lease ends, at most (a third of the lease when that is less).
MARGIN = 10.0

#: How much longer than measured a prefill may take, as a share of it, before decode idles
#: for want of a ready request.
SLACK = 0.25

#: (model, ahead now, its limit or None): told each time a model's count changes.
Shown = Callable[[str | None, int, "int | None"], None]

#: The other replicas' requests of a model ahead, as last heard (None: not known, Redis away).
Others = Callable[[str | None], "int | None"]


class Measured(Protocol):
    """What the queue measured of a model (``predictor.Rates``)."""

    def drain_rate(self, model: str | None) -> float | None: ...

    def prefill_seconds(self, model: str | None) -> float | None: ...


def needed(drain_rate: float, prefill_seconds: float, decodes: int) -> int:
    """How many requests must be ahead to keep decode fed (Little's law for the prefill
    pipeline): a decode slot frees ``drain_rate`` times a second and a request takes
    ``prefill_seconds`` (and ``SLACK`` more) to be ready; plus one per decode instance."""
    return math.ceil(drain_rate * prefill_seconds * (1 + SLACK)) + decodes


def guard_at(handed_at: float, lease: float) -> float:
    """When a request prefilled at ``handed_at`` leaves the ready lane for decode, whatever
    the caps: its ``lease`` less a margin (``MARGIN``, or a third of the lease)."""
    return handed_at + lease - min(MARGIN, lease / 3)


class RunAhead:
    """Each model's requests between their prefill slot and their decode slot, held under
    a limit."""

    def __init__(
        self,
        decode: BackendPool,
        share: Callable[[int], int] = lambda whole: whole,
        shown: Shown | None = None,
        measured: Measured | None = None,
        others: Others | None = None,
    ) -> None:
        """``share``: this process's part of a limit every replica holds together, while
        the others' count is not known; ``shown``: told of each change (the gauges);
        ``measured``: the rates that raise the limit to what keeps decode fed (None: the
        caps alone); ``others``: the other replicas' requests ahead (None: alone)."""
        self.decode = decode
        self.measured = measured
        self.share = share
        self.others = others
        self.shown: Shown = shown if shown is not None else _unseen
        #: ``--prefill-run-ahead`` (0: by the decode caps).
        self.set = 0
        self._ahead: dict[str | None, int] = {}
        self._behind: list[Callable[[], object]] = []

    def on_behind(self, told: Callable[[], object]) -> None:
        """``told()`` each time a request leaves the run-ahead: one more prefill may start."""
        self._behind.append(told)

    def limit(self, model: str | None) -> int | None:
        """The most requests of ``model`` ahead at once (None: no limit): the fleet's while
        the other replicas' count is known, else this replica's share."""
        whole = self._whole(model)
        if whole is None or self._others(model) is not None:
            return whole
        return self.share(whole)

    def _whole(self, model: str | None) -> int | None:
        if self.set:
            return self.set
        caps = self.decode.caps
        total = decodes = 0
        for instance in self.decode.instances:
            if model is not None and not instance.serves(model):
                continue
            slots = caps.slots(instance)
            if slots is None:
                return None  # (a decode instance with no cap: a ready request never waits)
            total += slots
            decodes += 1
        if not total:
            return None
        rates = self.measured
        rate = None if rates is None else rates.drain_rate(model)
        prefill = None if rates is None else rates.prefill_seconds(model)
        if rate and prefill:
            total = needed(rate, prefill, decodes)
        return total

    def _others(self, model: str | None) -> int | None:
        return None if self.others is None else self.others(model)

    def others_of(self, model: str | None) -> int | None:
        """The other replicas' requests of ``model`` ahead as last heard (None: not known,
        alone): what ``room`` holds against the fleet's limit (``/healthcheck``)."""
        return self._others(model)

    def ahead(self, model: str | None) -> int:
        return self._ahead.get(model, 0)

    def room(self, model: str | None) -> bool:
        """Whether one more prefill of ``model`` may start: this replica's requests ahead
        and the others' under the fleet's limit, or its own under its share."""
        whole = self._whole(model)
        if whole is None:
            return True
        others = self._others(model)
        if others is None:
            return self.ahead(model) < self.share(whole)
        return self.ahead(model) + others < whole

    def hold(self, model: str | None) -> Callable[[], None]:
        """One more request of ``model`` ahead; what gives its place back (once)."""
        self._change(model, 1)
        held = [True]

        def behind() -> None:
            if held:
                held.clear()
                self._change(model, -1)
                for told in self._behind:
                    told()

        return behind

    def _change(self, model: str | None, by: int) -> None:
        ahead = self._ahead.get(model, 0) + by
        if ahead:
            self._ahead[model] = ahead
        else:
            self._ahead.pop(model, None)
        self.shown(model, ahead, self.limit(model))


def _unseen(model: str | None, ahead: int, limit: int | None) -> None:
    """(No gauge is told.)"""
