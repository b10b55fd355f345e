"""vLLM's KV cache events, subscribed to per instance and kept in each pool's ``KvIndex``.

``KvEvents`` is a service: once a second (and at once after a pool
changes) it makes the subscriptions match the pools: an instance with an
events endpoint (its URL's ``kv-events=``, else its pool's
``--{pool}-kv-events-port``) gets an ``EventStream`` (``stream``), a SUB
socket on that endpoint and, with a replay port, a DEALER on the replay
endpoint; an instance that left its pool, or whose endpoint moved, loses
its stream and its entries (and a stream whose socket closed is made
anew). A data-parallel rank's ports are the declared ones plus its rank,
as vLLM offsets them. An instance of a ``kv-aware`` pool whose URL and
pool name no ports is asked where it publishes (``sources``: vLLM's
``GET /kv_event_sources``), and asked again once it comes back up after
being down, or its events connection was lost (it restarted). Each
worker under ``--workers`` subscribes (and asks) for itself: every
subscriber of a PUB socket gets every batch, so the workers' indexes
agree, at the memory and decoding cost of one index per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.health import State
from nixl_twisted.backends.holdings import Reach
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.upstream import Upstream
from nixl_twisted.config import ProxyConfig
from nixl_twisted.kv.index import KvIndex
from nixl_twisted.kv.sources import EventSources
from nixl_twisted.kv.stream import Endpoints, EventStream, endpoints

log = Logger()


@dataclass(frozen=True)
class PoolEvents:
    """A pool's default event ports, for instances whose URL names none (0: none)."""

    events_port: int = 0
    replay_port: int = 0


class KvEvents(Service):
    """Every instance's event stream, matched to the pools; one ``KvIndex`` per pool."""

    name = "kv-events"

    def __init__(
        self,
        reactor: Any,
        clock: IReactorTime,
        pools: Sequence[BackendPool],
        config: ProxyConfig,
        counted: Callable[[str, str, str], object] = lambda role, url, what: None,
        client: Upstream | None = None,
    ) -> None:
        """``counted``: told (role, url, kind) of each batch, gap, bad message (the metric);
        ``client``: asks instances where they publish (None: none is asked)."""
        self.reactor = reactor
        self.clock = clock
        self._pools = pools
        self.counted = counted
        self.indexes: dict[str, KvIndex] = {}
        self.defaults: dict[str, PoolEvents] = {}
        self.streams: dict[tuple[str, str], EventStream] = {}
        self.max_blocks = config.kv_events.max_blocks
        self._loop: LoopingCall | None = None
        self.sources = EventSources(client, clock, self._answered) if client is not None else None
        #: The instances asked where they publish (role, url); those seen down; the
        #: connections each stream had lost when last looked at.
        self.asked: dict[tuple[str, str], Instance] = {}
        self._down: set[str] = set()
        self._drops: dict[EventStream, int] = {}
        #: A look at the pools is under way; an answer came meanwhile (look again after).
        self._looking = False
        self._look_again = False
        #: Told of each prediction of new blocks (``--replicas-redis``: the other replicas).
        self._predicted: list[Callable[[str, str, Sequence[int], str | None], object]] = []
        self.configure(config)

    def configure(self, config: ProxyConfig) -> None:
        """Each pool's default ports and the index bound, as the config says now."""
        events = config.kv_events
        self.defaults = {role: PoolEvents(*events.ports(role)) for role in ("prefill", "decode")}
        max_blocks = self.max_blocks = events.max_blocks
        for index in self.indexes.values():
            index.max_blocks = max_blocks
        if self.sources is not None:
            self.sources.timeout = config.health.timeout
            self.sources.allowed = AllowedBackends(config.discovery.allowed)
        if self.running:
            self.reconcile()

    def index(self, role: str) -> KvIndex:
        if role not in self.indexes:
            self.indexes[role] = KvIndex(self.max_blocks, self.clock)
        return self.indexes[role]

    def stream(self, role: str, url: str) -> EventStream | None:
        return self.streams.get((role, url))

    def reconcile(self) -> None:
        """Subscribe to the instances that publish, and drop those that left or moved."""
        self._looking = True
        try:
            self._reconcile()
            while self._look_again:
                self._look_again = False
                self._reconcile()
        finally:
            self._looking = False

    def _reconcile(self) -> None:
        wanted: dict[tuple[str, str], tuple[Endpoints, Instance]] = {}
        self.asked = {}
        for pool in self._pools:
            default = self.defaults.get(pool.role, PoolEvents())
            for instance in pool.instances:
                where = endpoints(instance, default.events_port, default.replay_port)
                if where is None and self.sources is not None and pool.reads_events:
                    where = self._ask(pool.role, instance)
                if where is not None:
                    wanted[(pool.role, instance.url)] = (where, instance)
        if self.sources is not None:
            self.sources.keep({url.split("#", 1)[0] for _, url in self.asked})
        for key, stream in list(self.streams.items()):
            if key not in wanted or wanted[key][0] != stream.where or stream.closed:
                stream.close()
                del self.streams[key]
                self._drops.pop(stream, None)
                index = self.index(key[0])
                (index.clear if key in wanted else index.left)(key[1])
        for (role, url), (where, _) in wanted.items():
            if (role, url) not in self.streams:
                self.streams[(role, url)] = EventStream(
                    self.reactor, self.clock, url, where, self.index(role), self._counter(role, url)
                )
                log.info(
                    "{role} instance {url}: KV events from {where}",
                    role=role,
                    url=url,
                    where=where.events,
                )

    def _ask(self, role: str, instance: Instance) -> Endpoints | None:
        """Where the instance says it publishes; asked again if it restarted since."""
        assert self.sources is not None
        self.asked[(role, instance.url)] = instance
        base = instance.base
        if instance.state is State.DOWN:
            self._down.add(base)
        elif instance.healthy and base in self._down:
            self._down.discard(base)
            self.sources.again(base)
        stream = self.streams.get((role, instance.url))
        if stream is not None and stream.dropped > self._drops.get(stream, 0):
            self._drops[stream] = stream.dropped
            self.sources.again(base)
        said = self.sources.said(instance)
        return said if isinstance(said, Endpoints) else None

    def _answered(self) -> None:
        """An instance answered where it publishes: subscribed at once, not at the next look."""
        if self._looking:
            self._look_again = True
        elif self.running:
            self.reconcile()

    def _counter(self, role: str, url: str) -> Callable[[str], object]:
        return lambda what: self.counted(role, url, what)

    # -- what kv-aware asks (``holdings.Holdings``) --------------------------

    def reach(
        self, role: str, tokens: Sequence[int], urls: Collection[str], salt: str | None = None
    ) -> dict[str, Reach]:
        return self.index(role).reach(tokens, urls, salt=salt)

    def predict(
        self, role: str, url: str, tokens: Sequence[int], salt: str | None = None
    ) -> Callable[[], object]:
        index = self.index(role)
        prediction = index.predict(url, tokens, salt=salt)
        if prediction.keys:  # (blocks its events confirmed already: every replica reads them)
            for told in self._predicted:
                told(role, url, tokens, salt)
        return lambda: index.withdraw(prediction)

    def on_predicted(self, told: Callable[[str, str, Sequence[int], str | None], object]) -> None:
        """``told(role, url, tokens, salt)`` of each choice that predicted new blocks."""
        self._predicted.append(told)

    def foretold(
        self, role: str, url: str, tokens: Sequence[int], salt: str | None, age: float
    ) -> bool:
        """Another replica predicted these blocks on ``url`` ``age`` s ago: predicted here too,
        for what is left of their life (not told on); whether any of it was left."""
        index = self.index(role)
        predictions = index.predictions
        if predictions is None or age >= predictions.life:
            return False
        index.predict(url, tokens, salt=salt, expires=self.clock.seconds() + predictions.life - age)
        return True

    def blocks(self, role: str, url: str) -> int:
        index = self.index(role)
        return index.blocks(url) + index.predicted(url)

    def matched(
        self, role: str, tokens: Sequence[int], urls: Collection[str], salt: str | None = None
    ) -> dict[str, int]:
        """Per instance, the leading tokens of ``tokens`` its events say it holds."""
        return self.index(role).matched(tokens, urls, salt=salt)

    def listening(self, role: str, url: str) -> bool:
        return (role, url) in self.streams

    def stale(self, role: str, url: str) -> bool:
        stream = self.streams.get((role, url))
        return stream is not None and stream.sequencer.stale()

    def cached_tokens(
        self, instance: Instance, tokens: Sequence[int], salt: str | None = None
    ) -> int | None:
        """The leading tokens of a prompt ``instance`` holds (None: not known), for decide."""
        role, url = instance.role, instance.url
        if not self.listening(role, url) or self.stale(role, url):
            return None
        return self.matched(role, tokens, [url], salt).get(url, 0)

    def read(self, role: str, url: str) -> Deferred[None]:
        """Fires once the instance's next message has been taken in and applied (for tests)."""
        stream = self.streams.get((role, url))
        if stream is None:
            raise KeyError(f"no KV events are read from {role} instance {url}")
        return stream.read()

    def status(self, role: str, url: str) -> dict[str, Any] | None:
        """What /healthcheck and the admin listing say of an instance's events."""
        stream = self.streams.get((role, url))
        instance = self.asked.get((role, url))
        found: dict[str, Any] = {"found": "configured"}
        if instance is not None and self.sources is not None:
            found = self.sources.status(instance)
        elif stream is None:
            return None
        index = self.index(role)
        said = stream.status() if stream is not None else {**_NO_STREAM, "state": found["asked"]}
        return {
            **said,
            **found,
            "blocks": index.blocks(url),
            "predicted": index.predicted(url),
            "predictions": index.outcomes(url),
        }

    def startService(self) -> None:
        super().startService()
        self.reconcile()
        self._loop = LoopingCall(self.reconcile)
        self._loop.clock = self.clock
        self._loop.start(1.0, now=False)

    def stopService(self) -> Any:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()
        if self.sources is not None:
            self.sources.close()
            return self.sources.client.close()
        return None


#: What an instance asked where it publishes shows before it has a stream.
_NO_STREAM: dict[str, Any] = {
    "endpoint": None,
    "replay": None,
    "sequence": None,
    "bad_messages": 0,
    "last_bad": None,
    "dropped": 0,
}
