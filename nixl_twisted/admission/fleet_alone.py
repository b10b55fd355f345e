"""``AloneQueue``: where a replica's requests wait while Redis does not answer.

Its own ``FairQueue``, the caps held to their static share (``shared_slots``); until
Redis has answered once, no slot at all.
What it places is kept as leases (``keep``), written back with the rest when
Redis answers again; and then what still waits here leaves it (``rejoin``)
to ask the fleet's queue, since a request let go from here then would hold
slots Redis does not count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from nixl_twisted.admission.fair_queue import FairQueue
from nixl_twisted.admission.waiting import H, Pool, Waiting
from nixl_twisted.protocol.errors import ProxyError


class AloneQueue(Generic[H]):
    """This replica's own queue, and the fleet's requests that wait in it."""

    def __init__(
        self,
        local: FairQueue[H],
        keep: Callable[[H], object],
        reached: Callable[[], bool] = lambda: True,
    ) -> None:
        """``keep``: each placement made here, kept as leases; ``reached``: whether Redis has
        answered once (before, nothing is placed here: the static share of a fleet this
        replica has not seen would be the whole cap, ``fleet.first_contact``)."""
        self.local = local
        self.keep = keep
        self.reached = reached
        #: The requests that wait here, each on its ``inner`` Deferred.
        self._waiting: list[Waiting[H]] = []
        #: Called each time a new request starts to wait here.
        self.entered: Callable[[], object] = lambda: None

    def arrive(self, waiting: Waiting[H]) -> H | None:
        """A new request: its slots now, or None while it waits here (``entered`` told)."""
        got = self.enter(waiting)
        if got is None:
            self.entered()
        return got

    def pump(self) -> None:
        """Slots may have freed: the first requests waiting here go."""
        self.local.pump()

    def enter(self, waiting: Waiting[H]) -> H | None:
        """A new request: its slots now, or None while it waits here (``waiting.deferred``
        fires when it goes); raises the 503 that refuses it."""
        inner = self.local.enter(waiting.ticket, self._kept(waiting.place), waiting.arrived)
        if not isinstance(inner, Deferred):
            return inner
        self._wait(waiting, inner)
        return None

    def take(self, waiting: Waiting[H]) -> None:
        """A request that waited in the fleet's queue, or was about to, waits here instead."""
        try:
            got = self.enter(waiting)
        except ProxyError as error:
            waiting.done = True
            waiting.deferred.errback(error)
            return
        if got is not None:
            waiting.done = True
            waiting.deferred.callback(got)

    def rejoin(self) -> list[Waiting[H]]:
        """Redis answers again: what waits here leaves, in the order it came, for the
        fleet's queue (nothing fired; its timeout there counts from its arrival)."""
        leaving = []
        for waiting in self._waiting:
            if waiting.done or waiting.inner is None or not self.local.withdraw(waiting.inner):
                continue
            waiting.inner = None
            leaving.append(waiting)
        self._waiting = []
        return leaving

    def withdraw(self, deferred: Deferred[H]) -> bool:
        """The request answered on ``deferred`` leaves this queue, nothing fired."""
        for waiting in self._waiting:
            mine = waiting.deferred is deferred and not waiting.done
            if mine and waiting.inner is not None and self.local.withdraw(waiting.inner):
                waiting.done = True
                return True
        return False

    def _wait(self, waiting: Waiting[H], inner: Deferred[H]) -> None:
        waiting.inner = inner
        self._waiting.append(waiting)

        def got(placed: H) -> None:
            waiting.done = True
            waiting.deferred.callback(placed)

        def failed(failure: Failure) -> None:
            if not waiting.gone:
                waiting.done = True
                waiting.deferred.errback(failure)

        inner.addCallbacks(got, failed)

    def _kept(self, place: Callable[[], H | Pool]) -> Callable[[], H | Pool]:
        def placed() -> H | Pool:
            if not self.reached():
                return Pool.DECODE  # (its slots, once Redis counts them)
            got = place()
            if not isinstance(got, str):
                self.keep(got)
            return got

        return placed
