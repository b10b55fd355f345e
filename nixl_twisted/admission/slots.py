"""``Slots``: completions wait here for their legs' slots while instances are at their caps.

Each leg holds its slot only while its engine works on it. A two-leg
completion waits first for a prefill slot (``take_prefill``), then, once
prefill answered, for a decode slot (``take_decode``, the *ready* lane,
let go first); a completion that skips prefill, a batch's part and a moved
answer's continuation take what they need in one step (``take``). Between
its legs a request holds nothing but its prompt's KV on prefill, under
vLLM's lease, which no heartbeat renews while the proxy holds it: so
prefill runs at most ``run_ahead``'s limit ahead of decode, and a ready
request whose lease nears its end is sent to decode over its cap
(``lease_guard``), where vLLM's heartbeats renew it.

With no cap anywhere none of this runs: a completion chooses its decode
instance and goes, as vLLM's own queue takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from nixl_twisted.admission.fair_queue import FairQueue
from nixl_twisted.admission.lease_guard import LeaseGuard
from nixl_twisted.admission.predictor import Legged, Prediction
from nixl_twisted.admission.run_ahead import RunAhead
from nixl_twisted.admission.switched_queue import SwitchedQueue
from nixl_twisted.admission.waiting import Claim, Held, Lane, Pool
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.happened import Happened
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.targets import MAX_TTFT_MS, Target

#: Seconds between two looks at the queue while requests wait, besides each leg that
#: ends: an instance that came up, or joined, takes them too.
SWEEP = 1.0

#: What a completion's placement holds (``exchange.placing.Placed``).
H = TypeVar("H", bound=Held)

#: A placement of phase A (``exchange.placing.place_prefill``), given how far its model's
#: prefill runs ahead of decode.
PlaceAhead = Callable[[RunAhead], H | Pool]


class Slots:
    """The fair queue in front of the capped instances, and what it says of itself."""

    def __init__(
        self,
        backends: BackendService,
        clock: IReactorTime,
        queue: FairQueue[Any] | SwitchedQueue[Any],
        run_ahead: RunAhead | None = None,
        guarded: Callable[[Claim], object] = lambda claim: None,
    ) -> None:
        """``queue``: this process's (``FairQueue``) or every replica's, this one's own while
        Redis does not answer (``SwitchedQueue``), as the root chose; ``run_ahead``: how far
        prefill runs ahead of decode; ``guarded``: told of each lease guard."""
        self.backends = backends
        self.clock = clock
        self.run_ahead = run_ahead if run_ahead is not None else RunAhead(backends.decode)
        self.guarded = guarded
        #: vLLM's ``kv_lease_duration`` (``--kv-lease-duration``).
        self.kv_lease = 30.0
        #: (Typed as either store, not ``SlotQueue``: tests read what the fleet's last said.)
        self.queue: FairQueue[Any] | SwitchedQueue[Any] = queue
        self._sweep: IDelayedCall | None = None
        self._entered = Happened()
        queue.on_entered(self._waits)
        self.run_ahead.on_behind(queue.pump)
        for pool in backends.pools():
            pool.on_freed(queue.pump)

    def configure(self, config: ProxyConfig) -> None:
        """The queue's size and timeout from now on (those waiting keep their deadline)."""
        capacity = config.capacity
        self.queue.size = capacity.queue_size
        self.queue.timeout = capacity.queue_timeout
        self.run_ahead.set = capacity.prefill_run_ahead
        self.kv_lease = capacity.kv_lease_duration
        self.queue.pump()  # (and the pools pump it when their caps change: ``use_caps``)

    @property
    def needed(self) -> bool:
        """Whether any instance has a cap: else completions never wait here."""
        return self.backends.capped()

    def take(self, ticket: Claim, place: Callable[[], H | Pool]) -> H | Deferred[H]:
        """The slots ``place`` takes, now or once they free (``SlotQueue.enter``)."""
        return self.queue.enter(ticket, place)

    def take_prefill(self, ticket: Claim, place: PlaceAhead[H]) -> H | Deferred[H]:
        """Phase A: the prefill slot ``place`` takes (or, decided decode alone, the decode
        slot), now or once one frees and fewer than the model's limit run ahead."""
        return self.queue.enter(ticket, lambda: place(self.run_ahead))

    def take_decode(
        self,
        ticket: Claim,
        place: Callable[[], H | Pool],
        handed_at: float,
        forced: Callable[[], H],
    ) -> H | Deferred[H]:
        """Phase B: the decode slot ``place`` takes once prefill answered (at ``handed_at``),
        before any new request of its model; ``forced()``, over the cap, once its KV lease
        nears its end (the lease guard)."""
        ready = ticket.ready() if ticket.lane is Lane.WAIT else ticket
        taken = self.queue.enter(ready, place)
        if not isinstance(taken, Deferred):
            return taken
        guard = LeaseGuard(
            self.clock,
            self.queue.withdraw,
            ready,
            taken,
            handed_at,
            self.kv_lease,
            forced,
            self.guarded,
        )
        return guard.answer

    def predicted(self, ticket: Claim) -> Prediction | None:
        """The first token of a request of ``ticket`` entering the queue now (None: no
        target, or nothing measured yet: ``predictor``)."""
        return self.queue.predict(ticket)

    def measured(self, model: str | None, record: Legged, prefilled: bool) -> None:
        """A completion's decode leg ended (its slot freed): what its legs took, measured."""
        self.queue.rates.ended(model, record, prefilled)

    def rates_of(self, model: str | None) -> dict[str, float | None]:
        """What the queue predicts ``model``'s first tokens with, and the first token it
        predicts for a new request with a target now (the status page)."""
        rates = self.queue.rates
        prediction = self.queue.predict(Claim(model=model, target=Target(MAX_TTFT_MS, "status")))
        return {
            "decode_drain_rate": rates.drain_rate(model),
            "prefill_seconds": rates.prefill_seconds(model),
            "first_byte_seconds": rates.first_byte_seconds(model),
            "predicted_first_token_seconds": None if prediction is None else prediction.seconds,
        }

    def _waits(self) -> None:
        """A request starts to wait: the queue is looked at every second while one does."""
        if self._sweep is None:
            self._sweep = self.clock.callLater(SWEEP, self._look)
        entered, self._entered = self._entered, Happened()
        entered.fire()

    def entered(self) -> Deferred[None]:
        """Fires when a request next starts to wait (for tests and operators)."""
        return self._entered.wait()

    def _look(self) -> None:
        self._sweep = None
        self.queue.pump()
        if len(self.queue):
            self._sweep = self.clock.callLater(SWEEP, self._look)

    def shut(self) -> None:
        """The proxy stops: every request waiting is answered at once (503)."""
        if self._sweep is not None and self._sweep.active():
            self._sweep.cancel()
        self._sweep = None
        self.queue.shut(
            lambda: ProxyError(ErrorCode.DRAINING, "the proxy is shutting down", retry_after=1.0)
        )

    def status(self) -> list[dict[str, Any]]:
        """Each model's queue: how many wait for their first slot (``waiting``) and how many,
        prefilled, for their decode slot (``ready``), by tenant, the longest wait so far, and
        the requests ahead of decode against their limit (``/healthcheck``)."""
        now = self.clock.seconds()
        by_model: dict[str | None, dict[str, Any]] = {}
        for waiting in self.queue.waiting():
            ticket = waiting.ticket
            said = by_model.setdefault(
                ticket.model,
                {
                    "model": ticket.model,
                    "waiting": 0,
                    "ready": 0,
                    "longest_seconds": 0.0,
                    "tenants": {},
                    "ahead": self.run_ahead.ahead(ticket.model),
                    "ahead_limit": self.run_ahead.limit(ticket.model),
                    "others_ahead": self.run_ahead.others_of(ticket.model),
                },
            )
            said["ready" if ticket.is_ready else "waiting"] += 1
            said["longest_seconds"] = max(said["longest_seconds"], round(now - waiting.arrived, 3))
            tenants = said["tenants"]
            tenants[ticket.tenant or ""] = tenants.get(ticket.tenant or "", 0) + 1
        return list(by_model.values())
