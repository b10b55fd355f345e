"""``SharedRoutes``: one routing view for every replica of a proxy, through ``--replicas-redis``.

What this replica's policies choose is told to the others as it is chosen
(``outbox``, one call per reactor turn, never waited for): each
``cache-aware`` choice (a pool's memory of prefixes sent,
``backends.prefixes``) and each ``kv-aware`` prediction of blocks an
instance does not hold yet (``kv.predictions``). What the others chose is
read from the streams (``route_reader``) and applied here as if this
replica had chosen it: a prompt that follows one another replica sent
finds the instance it went to. An entry this replica told is skipped (it
was applied when it chose); a replica that starts, or starts again (a new
id), reads the streams from their start and routes on the fleet's memory
from its first request. What each replica's KV events confirm needs no
telling: every replica subscribes to every instance.

Redis away: nothing is told or heard, each replica routes on its own
memory, which it keeps; reads resume from where they stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred

from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.fleet import messages
from nixl_twisted.fleet.messages import Predicted, Sent
from nixl_twisted.fleet.outbox import Outbox
from nixl_twisted.fleet.replicas import Replicas
from nixl_twisted.fleet.route_reader import StreamReader
from nixl_twisted.fleet.route_scripts import PREDICTED, SENT
from nixl_twisted.happened import Happened
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.observe.replica_metrics import ReplicaMetrics


class SharedRoutes(Service):
    """This replica's routing choices told; the other replicas' applied."""

    name = "shared-routes"

    def __init__(
        self,
        replicas: Replicas,
        outbox: Outbox,
        pools: Callable[[], Sequence[BackendPool]],
        kv: KvEvents,
        metrics: ReplicaMetrics,
    ) -> None:
        self.replicas = replicas
        self.outbox = outbox
        self._pools = pools
        self.kv = kv
        self.metrics = metrics
        streams = [replicas.prefix + SENT, replicas.prefix + PREDICTED]
        self.reader = StreamReader(replicas.url, replicas.reactor, streams, self._heard)
        self._applied = Happened()
        for pool in pools():
            pool.sent.on_sent(partial(self._sent, pool.role))
        kv.on_predicted(self._predicted)

    def startService(self) -> None:
        super().startService()
        self.reader.start()

    def stopService(self) -> Any:
        super().stopService()
        self.outbox.stop()
        return self.reader.stop()

    def caught_up(self) -> Deferred[None]:
        """Fires once the streams' entries at start were applied (for tests and operators)."""
        return self.reader.caught_up()

    def applied(self) -> Deferred[None]:
        """Fires once the next entry another replica told was applied here (for tests)."""
        return self._applied.wait()

    # -- told -----------------------------------------------------------------------

    def _sent(self, role: str, chain: Sequence[int], url: str) -> None:
        self.outbox.tell(Sent(role, url, tuple(chain)))

    def _predicted(self, role: str, url: str, tokens: Sequence[int], salt: str | None) -> None:
        self.outbox.tell(Predicted(role, url, tokens, salt))

    # -- heard ----------------------------------------------------------------------

    def _heard(self, stream: str, text: str, age: float) -> None:
        replica, told = messages.read(text)
        if replica == self.replicas.id:
            return  # (applied as it chose)
        for each in told:
            if isinstance(each, Sent):
                pool = next((p for p in self._pools() if p.role == each.role), None)
                if pool is not None and pool.sent.remember(each.chain, each.url):
                    self.metrics.heard.labels(kind="sent").inc()
            elif self.kv.foretold(each.role, each.url, each.tokens, each.salt, age):
                self.metrics.heard.labels(kind="predicted").inc()
        applied, self._applied = self._applied, Happened()
        applied.fire()
