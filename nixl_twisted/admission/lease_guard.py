"""``LeaseGuard``: a prefilled request's wait for its decode slot, raced against its KV lease.

Prefill keeps a prompt's KV for decode under vLLM's lease, which no
heartbeat renews while the proxy, not decode's engine, holds the request.
A request still waiting for its decode slot when the lease nears its end
(``run_ahead.guard_at``) is taken out of the queue and sent over its decode
instance's cap (``forced``): vLLM's own queue holds it there and renews the
lease, where waiting on here would lose its prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nixl_twisted.admission.run_ahead import guard_at
from nixl_twisted.admission.waiting import Claim, H

#: Seconds before the guard looks again when the request could not be taken out of the
#: queue (its placement was being asked: it is placed, or waits again, soon).
AGAIN = 1.0

log = Logger()


class LeaseGuard(Generic[H]):
    """One ready request's decode slot: what the queue gives (``taken``), or ``forced()``
    once its lease nears its end; ``answer`` fires with whichever comes first."""

    def __init__(
        self,
        clock: IReactorTime,
        withdraw: Callable[[Deferred[H]], bool],
        ready: Claim,
        taken: Deferred[H],
        handed_at: float,
        lease: float,
        forced: Callable[[], H],
        guarded: Callable[[Claim], object],
    ) -> None:
        """``withdraw``: the queue's, to take ``taken``'s request out; ``handed_at``: when
        prefill answered (its lease began); ``guarded``: told when the guard fires."""
        self.clock = clock
        self.withdraw = withdraw
        self.ready = ready
        self.taken = taken
        self.handed_at = handed_at
        self.forced = forced
        self.guarded = guarded
        #: Cancelled, it cancels the queue's wait.
        self.answer: Deferred[H] = Deferred(lambda _: taken.cancel())
        due = guard_at(handed_at, lease)
        self._timer = clock.callLater(max(0.0, due - clock.seconds()), self._guard)
        taken.addCallbacks(self._went, self._failed)

    def _guard(self) -> None:
        if self.taken.called:
            return
        if not self.withdraw(self.taken):
            self._timer = self.clock.callLater(AGAIN, self._guard)
            return
        self.guarded(self.ready)
        log.warn(
            "lease guard: a request of {model} waited {waited:.1f} s for a decode slot; "
            "sent over its decode instance's cap before its KV lease ends",
            model=self.ready.model,
            waited=self.clock.seconds() - self.handed_at,
        )
        try:
            got = self.forced()
        except Exception as error:
            self.answer.errback(error)
            return
        self.answer.callback(got)

    def _went(self, got: H) -> None:
        if self._timer.active():
            self._timer.cancel()
        self.answer.callback(got)

    def _failed(self, failure: Any) -> None:
        if self._timer.active():
            self._timer.cancel()
        if not self.answer.called:
            self.answer.errback(failure)
