"""``Slots``: completions wait here for both their legs' slots while instances are at their caps.

A completion leaves the queue (``fair_queue``) only when its legs can all go:
its decode instance is chosen and held first (the rules may ask what it
holds), its prefill instance then, both under their caps
(``backends.capacity``); a completion that skips prefill needs a decode
slot only. The decode slot is held through the handoff, so that prefill
never runs ahead of decode: a request the proxy holds between its legs
gets no KV lease heartbeat from vLLM, one that waits here holds nothing.

With no cap anywhere none of this runs: a completion chooses its decode
instance and goes, as vLLM's own queue takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from nixl_twisted.admission.fair_queue import Claim, FairQueue, Pool
from nixl_twisted.admission.predictor import Legged
from nixl_twisted.admission.switched_queue import SwitchedQueue
from nixl_twisted.admission.waiting import Held
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


class Slots:
    """The fair queue in front of the capped instances, and what it says of itself."""

    def __init__(
        self,
        backends: BackendService,
        clock: IReactorTime,
        queue: FairQueue[Any] | SwitchedQueue[Any],
    ) -> None:
        """``queue``: this process's (``FairQueue``) or every replica's, this one's own while
        Redis does not answer (``SwitchedQueue``), as the root chose."""
        self.backends = backends
        self.clock = clock
        #: (Typed as either store, not ``SlotQueue``: tests read what the fleet's last said.)
        self.queue: FairQueue[Any] | SwitchedQueue[Any] = queue
        self._sweep: IDelayedCall | None = None
        self._entered = Happened()
        queue.on_entered(self._waits)
        for pool in backends.pools():
            pool.on_freed(queue.pump)

    def configure(self, config: ProxyConfig) -> None:
        """The queue's size and timeout from now on (those waiting keep their deadline)."""
        self.queue.size = config.capacity.queue_size
        self.queue.timeout = config.capacity.queue_timeout
        self.queue.pump()  # (and the pools pump it when their caps change: ``use_caps``)

    @property
    def needed(self) -> bool:
        """Whether any instance has a cap: else completions never wait here."""
        return self.backends.capped()

    def take(self, ticket: Claim, place: Callable[[], H | Pool]) -> H | Deferred[H]:
        """The slots ``place`` takes, now or once they free (``SlotQueue.enter``)."""
        return self.queue.enter(ticket, place)

    def predicted(self, ticket: Claim) -> float | None:
        """Seconds to the first token of a request of ``ticket`` entering the queue now
        (None: no target, or nothing measured yet: ``predictor``)."""
        prediction = self.queue.predict(ticket)
        return None if prediction is None else prediction.seconds

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
        """Each model's queue: how many wait, by tenant and the pool they wait for, and the
        longest wait so far (``/healthcheck``)."""
        now = self.clock.seconds()
        by_model: dict[str | None, dict[str, Any]] = {}
        for waiting in self.queue.waiting():
            ticket = waiting.ticket
            said = by_model.setdefault(
                ticket.model,
                {"model": ticket.model, "waiting": 0, "longest_seconds": 0.0, "tenants": {}},
            )
            said["waiting"] += 1
            said["longest_seconds"] = max(said["longest_seconds"], round(now - waiting.arrived, 3))
            tenants = said["tenants"]
            tenants[ticket.tenant or ""] = tenants.get(ticket.tenant or "", 0) + 1
        return list(by_model.values())
