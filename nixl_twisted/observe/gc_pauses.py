"""How long the garbage collector held the reactor's thread: ``nixlproxy_gc_pause_seconds``.

Every collection stops the whole process, and every request in flight
waits for it: a full one took 51-104 ms under 64 paced streams before the
startup heap was frozen (``run.heap``), 14-16 ms after (docs/performance.md,
"The first-token tail"). Each collection is timed by ``gc.callbacks`` and
noted in a plain list: the callback may run inside any code, even
prometheus_client's own under its lock, so the histogram is given the
pauses once a second, by the reactor, not there.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

#: Seconds: from a young collection's fraction of a millisecond to a stall a client feels.
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


class GcPauses(Service):
    """Times every collection while it runs; ``histogram`` is observed by generation."""

    def __init__(self, histogram: Any, clock: IReactorTime) -> None:
        self._histogram = histogram
        self._began = 0.0
        #: (generation, seconds) of the collections since the last fold.
        self._pending: list[tuple[int, float]] = []
        self._fold = LoopingCall(self.fold)
        self._fold.clock = clock

    def _called(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self._pending.append((info["generation"], time.perf_counter() - self._began))

    def fold(self) -> None:
        """Give the histogram the pauses noted since the last fold."""
        pending, self._pending = self._pending, []
        for generation, seconds in pending:
            self._histogram.labels(str(generation)).observe(seconds)

    def startService(self) -> None:
        super().startService()
        gc.callbacks.append(self._called)
        self._fold.start(1.0, now=False)

    def stopService(self) -> None:
        super().stopService()
        if self._called in gc.callbacks:
            gc.callbacks.remove(self._called)
        if self._fold.running:
            self._fold.stop()
        self.fold()
