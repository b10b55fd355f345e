"""``FairQueue``: requests that wait for their slots, let go in a fair order as slots free.

Pure (a clock, no I/O): what is waited for is the caller's, behind
``place``, which either takes the slots a request needs and returns what
it got, or names the pool it found full. The order:

- **classes first**: a lower priority goes first, as vLLM orders them;
  a negative priority is *sheddable*: it never waits, it is refused at
  once when it cannot be placed (llm-d's convention);
- **then fairness**: weighted fair queueing by requests (``model_lanes``):
  a tenant of weight 3 gets three requests let go for every one of a
  tenant of weight 1 while both wait;
- **within a tenant**: first come, first served, but the earliest
  first-token deadline first when its requests have targets
  (``deadlines``), and a request predicted to miss its target refused at
  once, before any room is made for it (from ``predictor``'s rates).

Each model waits apart, in two lanes; the ready lanes (prefilled requests
waiting for their decode slot) go first, so a decode slot that frees ends a
started request before a new one starts, and a ready request is never
refused for room, never shed and never timed out: its prefill is done. A
model's first request found its decode pool full: none behind it can go
either; found its prefill pool full: a request behind it that needs no
prefill (decode-only) may (at most ``TRIES`` tried per model per pump).

With ``size`` waiting in all (one room for every model), the request the
fair order lets go last is pushed out for a newcomer that goes before it
(``model_lanes.last_to_go``), else the newcomer is refused; past
``timeout`` seconds waited a request is refused. Each refusal is a 503
(``outcomes``) with ``Retry-After``: the time the queue takes to drain at
the rate it let requests go lately. A request whose client left is taken
out, and nothing is sent for it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from nixl_twisted.admission.deadlines import (
    latest_start,
    missed,
    predicted,
    swap_most_urgent,
    too_late,
)
from nixl_twisted.admission.model_lanes import (
    Key,
    LaneName,
    ModelLane,
    last_to_go,
    ready_first,
)
from nixl_twisted.admission.outcomes import (
    AFTER_WAIT,
    AT_ONCE,
    FAILED,
    LEFT,
    PUSHED_OUT,
    QUEUE_FULL,
    READY_AFTER_WAIT,
    READY_AT_ONCE,
    SHED,
    SHUT,
    TIMED_OUT,
    TTFT_REFUSED,
    QueueOutcome,
    QueueReport,
    drain_seconds,
    full,
    pushed_out,
    shed,
    timed_out,
)
from nixl_twisted.admission.predictor import Prediction, Rates
from nixl_twisted.admission.waiting import Claim, Pool, Waiting
from nixl_twisted.protocol.errors import ProxyError

T = TypeVar("T")

#: Requests of one model tried per pump once its first was blocked by a full prefill pool.
TRIES = 8
#: Requests let go lately, to say how fast the queue drains (``Retry-After``).
RECENT = 64


class FairQueue(Generic[T]):
    """Requests waiting for ``place`` to find them slots; see the module's docstring."""

    def __init__(
        self,
        clock: IReactorTime,
        size: int,
        timeout: float,
        told: QueueReport | None = None,
        rates: Rates | None = None,
    ) -> None:
        """``rates``: what the legs measured, to predict first tokens (None: none)."""
        self.clock = clock
        self.size = size
        self.timeout = timeout
        self.told: QueueReport = told if told is not None else _nobody
        self._entered: Callable[[], object] = _nobody_entered
        self._models: dict[LaneName, ModelLane] = {}
        self._order = itertools.count()
        self._waiting = 0
        #: Of those, the ready ones (never refused for room).
        self._ready = 0
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._pumping = False
        self._again = False
        self.rates = rates if rates is not None else Rates(clock)
        #: A model's requests past this queue (prefilling, or ready for decode): their decode
        #: slots come before a newcomer's (``RunAhead.ahead``, set by the root).
        self.committed: Callable[[str | None], int] = _none_committed
        #: Requests with a first-token target waiting (none: the order is the tags' alone).
        self._targeted = 0

    def __len__(self) -> int:
        """Requests waiting now."""
        return self._waiting

    def on_entered(self, entered: Callable[[], object]) -> None:
        """``entered()`` is called each time a request starts to wait."""
        self._entered = entered

    def enter(
        self, ticket: Claim, place: Callable[[], T | Pool], since: float | None = None
    ) -> T | Deferred[T]:
        """What ``place`` gives now, when nothing of its model waits ahead of it; else a
        Deferred that fires when it does, or fails with the 503 that says why not;
        ``since``: when it began to wait elsewhere (its timeout counts from then)."""
        queue = self._models.setdefault((ticket.model, ticket.lane), ModelLane())
        key = queue.key(ticket, next(self._order), self.clock.seconds())
        finish = key[1]
        if not queue.ahead(key):
            got = place()
            if not isinstance(got, str):
                queue.went_at_once(ticket.tenant, finish)
                self._let_go(ticket, 0.0, AT_ONCE)
                return got
            blocked: Pool | str = got
        else:
            blocked = ""
        if ticket.sheddable:
            self.told(SHED, 0.0, ticket)
            raise shed(ticket, self.retry_after())
        now = self.clock.seconds()
        arrived = now if since is None else min(since, now)
        prediction = predicted(
            self.rates,
            queue.heap,
            ticket,
            key,
            arrived,
            now,
            None,
            True,
            self.committed(ticket.model),
        )
        refusal = prediction and missed(prediction, ticket)
        if refusal:  # (before room is made for it: none pushed out for a refusal)
            self.told(TTFT_REFUSED, 0.0, ticket)
            raise refusal
        if (
            not ticket.is_ready
            and self._waiting - self._ready >= self.size
            and not self._push_out(queue, key)
        ):
            self.told(QUEUE_FULL, 0.0, ticket)
            raise full(self.size, self.retry_after())
        waiting: Waiting[T] = Waiting(ticket, place, arrived, finish=finish, order=key[2])
        waiting.blocked = blocked
        waiting.deferred = Deferred(lambda _: self._left(waiting))
        if not ticket.is_ready:
            waiting.timer = self.clock.callLater(
                max(0.0, self.timeout - (now - arrived)), self._expire, waiting
            )
        queue.add(key, waiting)
        self._waiting += 1
        self._ready += ticket.is_ready
        if ticket.target is not None:
            self._targeted += 1
            if prediction is not None:  # (its last chance: refused then if it still waits)
                at = latest_start(ticket, arrived, prediction) - now
                waiting.latest = self.clock.callLater(max(0.0, at), self._too_late, waiting)
        self._entered()
        return waiting.deferred

    def pump(self) -> None:
        """Slots may have freed: let go, in order, every request that can go now."""
        if self._pumping:
            self._again = True  # (a request let go freed a slot at once)
            return
        self._pumping = True
        try:
            self._again = True
            while self._again:
                self._again = False
                for model in sorted(self._models, key=ready_first):
                    self._pump(model)
        finally:
            self._pumping = False

    def shut(self, error: Callable[[], ProxyError]) -> None:
        """Every request waiting is refused with ``error()`` (the proxy is stopping)."""
        for queue in list(self._models.values()):
            for *_, waiting in list(queue.heap):
                if not waiting.done:
                    self._end(waiting, SHUT)
                    waiting.deferred.errback(error())
            queue.heap.clear()

    def retry_after(self) -> float:
        """Seconds the queue takes to drain at the rate it let requests go lately
        (1 at least, ``timeout`` at most, and ``timeout`` while nothing has gone)."""
        recent = self._recent
        span = recent[-1] - recent[0] if recent else 0.0
        return drain_seconds(len(recent), span, self._waiting, self.timeout)

    def withdraw(self, deferred: Deferred[T]) -> bool:
        """The request waiting on ``deferred`` leaves, nothing said or fired: it waits
        elsewhere now (``shared_queue``, when Redis answers again); whether it was here."""
        for queue in self._models.values():
            for *_, waiting in queue.heap:
                if waiting.deferred is deferred and not waiting.done:
                    waiting.done = True
                    self._waiting -= 1
                    self._ready -= waiting.ticket.is_ready
                    self._untimed(waiting)
                    return True
        return False

    def predict(self, ticket: Claim) -> Prediction | None:
        """The first token of a request of ``ticket`` entering now (None: no target, or
        nothing measured yet): for its access event, as ``enter`` judges it."""
        queue = self._models.get((ticket.model, ticket.lane), ModelLane())
        key = queue.key(ticket, next(self._order), self.clock.seconds())
        now = self.clock.seconds()
        return predicted(
            self.rates, queue.heap, ticket, key, now, now, committed=self.committed(ticket.model)
        )

    def waiting(self) -> list[Waiting[T]]:
        """Every request waiting now (``/healthcheck``, the depth gauge)."""
        return [w for lane in self._models.values() for w in lane.live()]

    # -- inside -------------------------------------------------------------------

    def _push_out(self, queue: ModelLane, key: Key) -> bool:
        """The queue is full: the request the fair order lets go last leaves for a newcomer
        (``key``, of ``queue``), unless that is the newcomer; whether one left."""
        last = last_to_go(self._models, queue, key)
        if last is None:
            return False
        _, waiting = last
        self._end(waiting, PUSHED_OUT)
        waiting.deferred.errback(pushed_out(self.size, self.retry_after()))
        return True

    def _pump(self, model: LaneName) -> None:
        queue = self._models[model]
        tried = 0
        passed: list[tuple[int, float, int, Waiting[Any]]] = []
        while queue.heap and tried < TRIES:
            item = queue.heap[0]
            waiting = item[-1]
            if waiting.done:
                heapq.heappop(queue.heap)
                continue
            tried += 1
            if self._targeted or queue.reordered:  # (its tenant's most urgent takes its tag)
                queue.reordered |= swap_most_urgent(queue.heap, self.clock.seconds())
                waiting = queue.heap[0][-1]
            try:
                got = waiting.place()
            except Exception as error:  # (no instance at all: the request's own error)
                heapq.heappop(queue.heap)
                self._end(waiting, FAILED)
                waiting.deferred.errback(error)
                continue
            if isinstance(got, str):
                waiting.blocked = got
                if got != Pool.PREFILL:
                    break  # (every request of this model needs a decode slot)
                passed.append(heapq.heappop(queue.heap))
                continue
            heapq.heappop(queue.heap)
            queue.went(waiting)
            self._end(waiting, AFTER_WAIT)
            waiting.deferred.callback(got)
        for item in passed:
            heapq.heappush(queue.heap, item)
        if not queue.heap and queue.emptied():
            del self._models[model]

    def _end(self, waiting: Waiting[T], outcome: QueueOutcome) -> None:
        """The request leaves the queue, ``outcome`` said of it (unserved: its tenant is not
        charged for it, ``ModelLane.give_back``)."""
        waiting.done = True
        lane = self._models.get((waiting.ticket.model, waiting.ticket.lane))
        if outcome not in (AFTER_WAIT, SHUT) and lane is not None:
            lane.give_back(waiting)
        self._waiting -= 1
        self._ready -= waiting.ticket.is_ready
        self._untimed(waiting)
        waited = self.clock.seconds() - waiting.arrived
        if outcome == AFTER_WAIT:
            self._let_go(waiting.ticket, waited, outcome)
        else:
            self.told(outcome, waited, waiting.ticket)

    def _untimed(self, waiting: Waiting[T]) -> None:
        """Its timers cancelled (it no longer waits here)."""
        for timer in (waiting.timer, waiting.latest):
            if timer is not None and timer.active():
                timer.cancel()
        if waiting.ticket.target is not None:
            self._targeted -= 1

    def _too_late(self, waiting: Waiting[T]) -> None:
        """Its latest start came and it still waits: refused, as at its arrival."""
        if not waiting.done:
            heap = self._models[(waiting.ticket.model, waiting.ticket.lane)].heap
            now = self.clock.seconds()
            refusal = too_late(self.rates, heap, waiting, now, self.committed(waiting.ticket.model))
            self._end(waiting, TTFT_REFUSED)
            waiting.deferred.errback(refusal)

    def _let_go(self, ticket: Claim, waited: float, outcome: QueueOutcome) -> None:
        if ticket.is_ready:
            outcome = READY_AT_ONCE if outcome == AT_ONCE else READY_AFTER_WAIT
        else:  # (the drain rate is of requests let go to start)
            self._recent.append(self.clock.seconds())
        self.told(outcome, waited, ticket)

    def _expire(self, waiting: Waiting[T]) -> None:
        if waiting.done:
            return
        self._end(waiting, TIMED_OUT)
        waiting.deferred.errback(timed_out(self.timeout, self.retry_after()))

    def _left(self, waiting: Waiting[T]) -> None:
        """Its client left while it waited: taken out, nothing sent for it."""
        if not waiting.done:
            self._end(waiting, LEFT)


def _nobody(outcome: QueueOutcome, waited: float, ticket: Claim) -> None:
    """No one to tell."""


def _nobody_entered() -> None:
    """(No one is told that a request started to wait.)"""


def _none_committed(model: str | None) -> int:
    """(No request of a model known past the queue.)"""
    return 0
