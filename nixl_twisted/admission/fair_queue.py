"""``FairQueue``: requests that wait for their slots, let go in a fair order as slots free.

Pure (a clock, no I/O): what is waited for is the caller's, behind
``place``, which either takes the slots a request needs and returns what
it got, or names the pool it found full. The order:

- **classes first**: a lower priority goes first, as vLLM orders them;
  a negative priority is *sheddable*: it never waits, it is refused at
  once when it cannot be placed (llm-d's convention);
- **then fairness**: weighted fair queueing by requests, self-clocked
  (SCFQ): each request is tagged ``max(V, its tenant's last tag) + 1 /
  weight``, where ``V`` is the tag of the request let go last, and the
  smallest tag goes first; a tenant of weight 3 gets three requests let go
  for every one of a tenant of weight 1 while both wait;
- **within a tenant**: first come, first served (its tags only grow), but
  the earliest first-token deadline first when its requests have targets
  (``deadlines``: when a tenant's tag comes up its most urgent request takes
  it), and a request predicted to miss its target refused at once
  (``deadlines``, from ``predictor``'s measured rates).

Requests wait per model, each model's with its own order: one model's
backlog never holds another's, since their instances differ. Each model
has two lanes (``Lane``): requests waiting for their first slot, and
requests prefilled that wait for their decode slot (*ready*), in the same
order but their own; the ready lanes are let go first (a decode slot that
frees goes to a prefilled request before a new one starts), and a ready
request is never refused for room, never shed and never timed out. A model's
first request found its decode pool full: none behind it can go either;
found its prefill pool full: a request behind it that needs no prefill
(decode-only) may (at most ``TRIES`` tried per model per pump).

With ``size`` waiting in all (one room for every model), the request the
fair order lets go last (largest priority, finish tag past its model's
clock, arrival) is *pushed out* for a newcomer, its tenant's last tag given
back (it is charged for no request it was not served); a newcomer that
would be last is refused. Past ``timeout`` seconds waited a request is
refused. Each refusal is a 503 with ``Retry-After`` (the time the queue
takes to drain at the rate it has let requests go lately); a request whose
client left is taken out, and nothing is sent for it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
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
from nixl_twisted.admission.predictor import Prediction, Rates
from nixl_twisted.admission.waiting import Claim, Lane, Pool, Waiting
from nixl_twisted.config.words import counted
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

T = TypeVar("T")

#: Requests of one model tried per pump once its first was blocked by a full prefill pool.
TRIES = 8
#: Requests let go lately, to say how fast the queue drains (``Retry-After``).
RECENT = 64


class QueueOutcome(str, Enum):
    """What happened to a request at the queue (``nixlproxy_admissions_total{outcome}``:
    its value, as ``str()`` gives it)."""

    AT_ONCE = "at_once"
    AFTER_WAIT = "after_wait"
    QUEUE_FULL = "queue_full"
    TIMED_OUT = "timed_out"
    SHED = "shed"
    LEFT = "left"
    SHUT = "shut"
    #: ``place`` raised: no instance at all (the request's own error).
    FAILED = "failed"
    #: A prefilled request took its decode slot at once, or after it waited (ready lane).
    READY_AT_ONCE = "ready_at_once"
    READY_AFTER_WAIT = "ready_after_wait"
    #: It waited, and left the full queue for a newcomer the fair order lets go first.
    PUSHED_OUT = "pushed_out"
    #: Predicted to miss its first-token target, or still waiting at its latest start.
    TTFT_REFUSED = "ttft_refused"

    def __str__(self) -> str:
        return self.value


AT_ONCE, AFTER_WAIT, QUEUE_FULL, TIMED_OUT, SHED, LEFT, SHUT, FAILED = list(QueueOutcome)[:8]
READY_AT_ONCE, READY_AFTER_WAIT = QueueOutcome.READY_AT_ONCE, QueueOutcome.READY_AFTER_WAIT
PUSHED_OUT = QueueOutcome.PUSHED_OUT
TTFT_REFUSED = QueueOutcome.TTFT_REFUSED


#: Tags kept per model while nothing of it waits, before those behind its clock go.
KEPT_TAGS = 64

#: (outcome, seconds waited, the request's ticket): told of every request's outcome.
QueueReport = Callable[[QueueOutcome, float, "Claim"], None]


@dataclass
class _ModelQueue:
    """One model's waiting requests, in order, and its fair-queueing clock."""

    heap: list[tuple[int, float, int, Waiting[Any]]] = field(default_factory=list)
    #: The tag of the request let go last (SCFQ's virtual time).
    now: float = 0.0
    #: Each tenant's last tag, while it is ahead of ``now``.
    last: dict[str | None, float] = field(default_factory=dict)
    #: A request was let go before its tenant's earlier ones (those keep first come, first
    #: served among themselves until the queue is empty).
    reordered: bool = False


def shed(ticket: Claim, retry_after: float) -> ProxyError:
    """A sheddable request refused while every instance is at its cap (503 ``shed``)."""
    return ProxyError(
        ErrorCode.SHED,
        "every instance is at its cap and this tenant's requests are sheddable (priority "
        f"{ticket.priority}): try again later",
        retry_after=retry_after,
    )


def full(size: int, retry_after: float) -> ProxyError:
    """A request refused by a full queue (503 ``queue_full``)."""
    return ProxyError(
        ErrorCode.QUEUE_FULL,
        f"the proxy's queue is full ({counted(size, 'request')} waiting for a slot): "
        "try again later",
        retry_after=retry_after,
    )


def pushed_out(size: int, retry_after: float) -> ProxyError:
    """A waiting request that left the full queue for one the fair order lets go first
    (503 ``queue_full``; the access event's ``ended``: ``pushed_out``)."""
    return ProxyError(
        ErrorCode.QUEUE_FULL,
        f"the proxy's queue is full ({counted(size, 'request')} waiting for a slot) and "
        "this request was the one its fair order would let go last: try again later",
        retry_after=retry_after,
        ended=str(PUSHED_OUT),
    )


def timed_out(timeout: float, retry_after: float) -> ProxyError:
    """A request that waited its whole ``--queue-timeout`` (503 ``queue_timeout``)."""
    return ProxyError(
        ErrorCode.QUEUE_TIMEOUT,
        f"no slot came free within the proxy's queue timeout ({timeout:g} s): try again later",
        retry_after=retry_after,
    )


def drain_seconds(went: int, span: float, waiting: int, timeout: float) -> float:
    """Seconds ``waiting`` requests take to go at the rate ``went`` went over ``span``
    seconds: 1 at least, ``timeout`` at most, and ``timeout`` while fewer than two went."""
    if went < 2:
        return timeout
    if span <= 0:
        return 1.0
    rate = (went - 1) / span
    return float(min(timeout, max(1, math.ceil(waiting / rate))))


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
        self._models: dict[tuple[str | None, Lane], _ModelQueue] = {}
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
        #: Requests with a first-token target waiting (none: the order is today's exactly).
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
        queue = self._models.setdefault((ticket.model, ticket.lane), _ModelQueue())
        start = max(queue.now, queue.last.get(ticket.tenant, 0.0))
        finish = start + 1.0 / ticket.weight
        key = (ticket.priority, finish, next(self._order))
        if not self._ahead(queue, key):
            got = place()
            if not isinstance(got, str):
                queue.now = finish
                queue.last[ticket.tenant] = finish
                if len(queue.last) > KEPT_TAGS and not queue.heap:
                    queue.last = {t: f for t, f in queue.last.items() if f > queue.now}
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
        queue.last[ticket.tenant] = finish
        waiting: Waiting[T] = Waiting(ticket, place, arrived, finish=finish, order=key[2])
        waiting.blocked = blocked
        waiting.deferred = Deferred(lambda _: self._left(waiting))
        if not ticket.is_ready:
            waiting.timer = self.clock.callLater(
                max(0.0, self.timeout - (now - arrived)), self._expire, waiting
            )
        heapq.heappush(queue.heap, (*key, waiting))
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
                for model in sorted(self._models, key=_ready_first):
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
        queue = self._models.get((ticket.model, ticket.lane), _ModelQueue())
        start = max(queue.now, queue.last.get(ticket.tenant, 0.0))
        key = (ticket.priority, start + 1.0 / ticket.weight, next(self._order))
        now = self.clock.seconds()
        return predicted(
            self.rates, queue.heap, ticket, key, now, now, committed=self.committed(ticket.model)
        )

    def waiting(self) -> list[Waiting[T]]:
        """Every request waiting now (``/healthcheck``, the depth gauge)."""
        return [w for q in self._models.values() for *_, w in q.heap if not w.done]

    # -- inside -------------------------------------------------------------------

    def _ahead(self, queue: _ModelQueue, key: tuple[int, float, int]) -> bool:
        """Whether a request of the same model waits ahead of ``key``."""
        while queue.heap and queue.heap[0][-1].done:
            heapq.heappop(queue.heap)
        return bool(queue.heap) and queue.heap[0][:3] < key

    def _push_out(self, queue: _ModelQueue, key: tuple[int, float, int]) -> bool:
        """The queue is full: the request the fair order lets go last leaves for a newcomer
        (``key``, of ``queue``), unless that is the newcomer; whether one left."""
        last = max(
            (
                ((p, f - q.now, n), q, w)
                for (_, lane), q in self._models.items()
                if lane is not Lane.READY  # (prefilled: never leaves for room)
                for p, f, n, w in q.heap
                if not w.done
            ),
            key=lambda item: item[0],
            default=None,
        )
        if last is None or last[0] <= (key[0], key[1] - queue.now, key[2]):
            return False
        _, its, waiting = last
        tenant = waiting.ticket.tenant
        if its.last.get(tenant) == waiting.finish:  # (its tag back: never served)
            its.last[tenant] = waiting.finish - 1.0 / waiting.ticket.weight
        self._end(waiting, PUSHED_OUT)
        waiting.deferred.errback(pushed_out(self.size, self.retry_after()))
        return True

    def _pump(self, model: tuple[str | None, Lane]) -> None:
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
            queue.now = max(queue.now, waiting.finish)
            self._end(waiting, AFTER_WAIT)
            waiting.deferred.callback(got)
        for item in passed:
            heapq.heappush(queue.heap, item)
        if not queue.heap:
            queue.reordered = False
            # Tags behind the clock are as good as none: only those ahead are kept.
            queue.last = {t: f for t, f in queue.last.items() if f > queue.now}
            if not queue.last:
                del self._models[model]

    def _end(self, waiting: Waiting[T], outcome: QueueOutcome) -> None:
        """The request leaves the queue, ``outcome`` said of it."""
        waiting.done = True
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


def _ready_first(model: tuple[str | None, Lane]) -> bool:
    """Ready lanes sort first (``False``), each model's in the order it came."""
    return model[1] is not Lane.READY


def _nobody(outcome: QueueOutcome, waited: float, ticket: Claim) -> None:
    """No one to tell."""


def _nobody_entered() -> None:
    """(No one is told that a request started to wait.)"""


def _none_committed(model: str | None) -> int:
    """(No request of a model known past the queue.)"""
    return 0
