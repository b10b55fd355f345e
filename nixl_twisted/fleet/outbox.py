"""``Outbox``: what this replica tells the fleet's routing view, one Redis call per reactor turn.

A routing choice (``routes``) or a stored response's instance
(``responses``) is put here as it is made, and every choice of one turn
of the reactor goes in one call of ``route_scripts.share``, made at the
next turn and never waited for: a request never waits for Redis to hear of
its route. A call Redis does not take (away, or over its budget) is
dropped, as ``Replicas`` decides: each replica then routes on its own
memory, which it keeps whatever Redis says.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure

from nixl_twisted.fleet import messages, route_scripts
from nixl_twisted.fleet.messages import Sent, Told
from nixl_twisted.fleet.replicas import Replicas, Unshared
from nixl_twisted.observe.replica_metrics import ReplicaMetrics


class Outbox:
    """This replica's choices and stored responses of one turn, sent together."""

    def __init__(
        self, replicas: Replicas, reactor: Any, metrics: ReplicaMetrics, per_owner: int = 1000
    ) -> None:
        """``reactor``: the next turn (``callLater(0)``); ``per_owner``: the stored responses
        Redis keeps per tenant (``--responses-per-tenant``)."""
        self.replicas = replicas
        self.per_owner = per_owner
        self.reactor = reactor
        self.metrics = metrics
        self._sent: list[str] = []
        self._predicted: list[str] = []
        self._responses: list[route_scripts.StoredResponse] = []
        self._due: IDelayedCall | None = None

    def tell(self, told: Told) -> None:
        """A routing choice, told to the other replicas at the next turn."""
        said = messages.line(told)
        if said is None:
            return
        kind = "sent" if isinstance(told, Sent) else "predicted"
        (self._sent if kind == "sent" else self._predicted).append(
            messages.entry(self.replicas.id, [said])
        )
        self.metrics.told.labels(kind=kind).inc()
        self._soon()

    def stored(self, response_id: str, instance_url: str, owner: str | None) -> None:
        """A stored response's decode instance and owner, kept in Redis for every replica."""
        self._responses.append(route_scripts.StoredResponse(response_id, instance_url, owner or ""))
        self.metrics.told.labels(kind="response").inc()
        self._soon()

    def _soon(self) -> None:
        if self._due is None:
            self._due = self.reactor.callLater(0, self.flush)

    def flush(self) -> None:
        """Everything told since the last flush, in one call (none when nothing was)."""
        self._due = None
        sent, predicted, responses = self._sent, self._predicted, self._responses
        self._sent, self._predicted, self._responses = [], [], []
        if not (sent or predicted or responses):
            return
        shared = route_scripts.share(self.replicas, sent, predicted, responses, self.per_owner)
        shared.addErrback(_dropped)

    def stop(self) -> None:
        """Nothing more is sent (what waits for the next turn is dropped)."""
        if self._due is not None and self._due.active():
            self._due.cancel()
        self._due = None
        self._sent, self._predicted, self._responses = [], [], []


def _dropped(failure: Failure) -> None:
    """Redis did not take it: every replica keeps routing on what it knows."""
    failure.trap(Unshared)
