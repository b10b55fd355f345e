"""One completion's phase machine: where it stands, what its client leaving does.

The phases are ``nixl_twisted.protocol.phases``'s, whose ``RULES`` table
says what a client disconnect does in each and which timer bounds it.
Before the client got a byte a timeout is a 504; after, the stream ends
with an error event (or the connection is closed short) and is never passed
off as complete. The exchange (``two_legs``) makes one ``Phases`` and hands
it to each of its legs (``prefill_leg``, ``decode_leg``), which say through
it where they stand, what they wait for and which attempt is out.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.exchange.relay import break_off
from nixl_twisted.exchange.request import ExchangeRequest
from nixl_twisted.exchange.sending import PrefillRefused
from nixl_twisted.happened import Happened
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import NO_ATTEMPT, AttemptTrace
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.phases import RULES, OnClientLeft, Phase

log = Logger()

T = TypeVar("T")

#: What a completion cut short by the drain timeout is told.
SHUTTING_DOWN = "the proxy is shutting down: its drain timeout ended"


class Phases:
    """Where one completion stands, what it waits for, and what its client leaving does."""

    def __init__(
        self, request: ExchangeRequest, record: AccessRecord, metrics: ProxyMetrics, request_id: str
    ) -> None:
        self.request = request
        self.record = record
        self.metrics = metrics
        self.request_id = request_id
        #: The span of the attempt out now (a no-op when not traced).
        self._attempt: AttemptTrace = NO_ATTEMPT
        #: The phases entered so far, and who waits for one not yet (``reached``).
        self._entered: set[Phase] = set()
        self._reached: dict[Phase, Happened] = {}
        self.enter(Phase.PREFILL)
        #: Why nobody waits for the answer any more (its client left), or None.
        self.client_gone: str | None = None
        #: The drain timeout ended: the proxy itself cuts this request.
        self.shutting_down = False
        #: Decode broke off: the proxy closed the client's connection, not the client.
        self._broke_off = False
        self._current: Deferred[Any] | None = None

    def start(self, run: Callable[[], Coroutine[Any, Any, None]]) -> Deferred[None]:
        """``run()``, in a Deferred that Klein cancels on disconnect (``RULES`` say how)."""
        outcome: Deferred[None] = Deferred(self._client_left)

        def settle(result: object) -> None:
            if not outcome.called:
                if isinstance(result, Failure):
                    outcome.errback(result)
                else:
                    outcome.callback(None)
            elif isinstance(result, Failure) and not result.check(
                CancelledError, ProxyError, PrefillRefused
            ):
                log.failure(
                    "error finishing {request_id} after its client left",
                    result,
                    request_id=self.request_id,
                )

        ensureDeferred(run()).addBoth(settle)
        return outcome

    async def cut_short(self) -> None:
        """The drain timeout cut this request (``shut_down``): a 503 if the client has had
        nothing yet, else the stream ends with an error event."""
        if not self.request.startedWriting:
            # (called while the cancellation is handled: it is not this error's cause)
            raise ProxyError(ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN, retry_after=1.0) from None
        await break_off(self.request, SHUTTING_DOWN, ErrorCode.SHUTTING_DOWN)

    def enter(self, phase: Phase) -> None:
        self.phase = phase
        self.record.phase = phase
        self._entered.add(phase)
        if self._reached:  # (someone waits: a test, an operator)
            waited = self._reached.pop(phase, None)
            if waited is not None:
                waited.fire()

    def reached(self, phase: Phase | str) -> Deferred[None]:
        """Fires once the exchange has entered ``phase`` (for tests and operators)."""
        phase = Phase(phase)
        if phase in self._entered:
            return succeed(None)
        return self._reached.setdefault(phase, Happened()).wait()

    def track(self, waiting: Deferred[T]) -> Deferred[T]:
        """``waiting`` is what the exchange waits for now: a disconnect or shutdown cancels it."""
        self._current = waiting
        return waiting

    def attempting(self, span: AttemptTrace) -> None:
        """``span`` is the attempt out now: a disconnect or shutdown ends it, saying why."""
        self._attempt = span

    def failed(self, why: str, phase: str | None = None) -> None:
        """The attempt out now failed (``phase``: where, the current phase by default)."""
        self._attempt.fail(why, self.phase.value if phase is None else phase)

    def breaking_off(self) -> None:
        """The proxy is closing the client's connection itself, having said why."""
        self._broke_off = True

    def shut_down(self) -> None:
        """Cut this request, saying so: a 503 if nothing was sent, else an error event."""
        self.shutting_down = True
        self.record.ended = "shutting_down"
        self.failed(SHUTTING_DOWN)
        if self._current is not None:
            self._current.cancel()

    def _client_left(self, _: Deferred[None]) -> None:
        if self.shutting_down or self._broke_off:
            return  # the proxy closed the connection, after saying why
        # A batch's part the batch itself cancelled says why; else the client left.
        why = getattr(self.request, "ended_by", None)
        if why is None:
            why = f"client left during {self.phase.value}"
            self.metrics.client_disconnects.labels(self.phase.value).inc()
            log.info(
                "client left {request_id} during {phase}",
                request_id=self.request_id,
                phase=self.phase.value,
            )
        self.client_gone = why
        if RULES[self.phase].on_client_left is OnClientLeft.CANCEL and self._current is not None:
            self.failed(why)
            self._current.cancel()
