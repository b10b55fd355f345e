"""What the supervisor and its workers tell each other, so that ``--workers N`` is one proxy.

The supervisor owns the pools' membership and health: it runs the health
checks, judges the outcomes the workers report, and tells every worker the
verdicts, so that all serve the same pools and ``/healthcheck`` says the
same whichever worker answers. One JSON object per line; the supervisor
writes to a worker's standard input (after its configuration line), a
worker to its file descriptor 3::

    supervisor -> worker  {"health": [Instance.health(), ...]}    verdicts
                          {"config": ProxyConfig.to_json()}      SIGHUP's reload
                          {"change": {"op", "pool", "url"}}       made at another worker
                          {"done": N}                             change N reached all
                          {"discovered": {"pool", "source", "urls", "retire"}}  a source's
                          {"sources": [...], "errors": [...]}     the sources' states, failures
    worker -> supervisor  {"outcome": {"pool", "url", "failure"}} a leg's outcome
                          {"change": {...}, "id": N}              an admin API change
                          {"alone": {URL: tokens}}                decode-only prompt tokens
                                                                  sent since, each second
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol as WireProtocol
from twisted.internet.stdio import StandardIO
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.backends.checks import HealthChecks
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import PoolChangeRefused
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ConfigError, Pools, ProxyConfig
from nixl_twisted.discovery.report import HeardReport

log = Logger()

Message = dict[str, Any]

#: The worker's end of the pipe to its supervisor.
FROM_SUPERVISOR = 0
TO_SUPERVISOR = 3


def encode(message: Message) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode("utf-8") + b"\n"


class Lines:
    """Cuts a byte stream into messages, one JSON object per line."""

    def __init__(self, deliver: Callable[[Message], None]) -> None:
        self._deliver = deliver
        self._buffer = b""

    def feed(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                log.error("not a message, dropped: {line!r}", line=line[:200])
                continue
            self._deliver(message)


def _apply(backends: BackendService, change: dict[str, str], where: str) -> None:
    try:
        backends.apply_change(change)
    except PoolChangeRefused as error:  # the pools are the same everywhere: should not be
        log.error(
            "{where}: change {change} refused: {error}",
            where=where,
            change=change,
            error=str(error),
        )


# -- the supervisor's side ---------------------------------------------------


class Peer(Protocol):
    """A worker, as the coordinator sees it."""

    def send(self, message: Message) -> None: ...


class Coordinator:
    """In the supervisor: the one place pools and health are decided for all workers."""

    def __init__(
        self,
        backends: BackendService,
        checks: HealthChecks,
        peers: Callable[[], Iterable[Peer]],
    ) -> None:
        self.backends = backends
        self.checks = checks
        self._peers = peers
        #: What each discovery source lists now, for workers started later.
        self._discovered: dict[tuple[str, str], tuple[str, ...]] = {}
        #: What discovery last said of its sources, for workers started later.
        self._report = HeardReport()
        for pool in backends.pools():
            pool.on_change = self._health_changed

    def welcome(self, worker: Peer) -> None:
        """What a new worker is told first: what each source lists, every instance's health."""
        for (role, source), urls in self._discovered.items():
            worker.send({"discovered": {"pool": role, "source": source, "urls": list(urls)}})
        sources, errors = self._report.sources(), self._report.errors()
        if sources or errors:
            worker.send({"sources": sources, "errors": errors})
        worker.send({"health": [i.health() for p in self.backends.pools() for i in p.instances]})

    def pools(self, names: Pools | None = None) -> Pools:
        """The instances given now, and the DNS names (what a restarted worker starts with).

        Discovered instances are not in it: ``welcome`` tells each worker
        what every source lists, so that they stay discovered (and drain
        when their source stops listing them).
        """
        prefill, decode = self.backends.prefill.given, self.backends.decode.given
        if names is not None:
            prefill, decode = prefill + names.names("prefill"), decode + names.names("decode")
        return Pools(prefill, decode)

    def discovered(
        self, role: str, source: str, urls: tuple[str, ...], retire: bool = False
    ) -> None:
        """A source lists these now (applied here already): every worker applies it too."""
        if urls:
            self._discovered[(role, source)] = urls
        else:
            self._discovered.pop((role, source), None)
        found = {"pool": role, "source": source, "urls": list(urls), "retire": retire}
        self._send_all({"discovered": found})

    def sources(self, status: list[dict[str, Any]], errors: list[dict[str, Any]]) -> None:
        """The sources' states changed: every worker's /healthcheck and /metrics say it."""
        self._report.told(status, errors)
        self._send_all({"sources": status, "errors": errors})

    def received(self, origin: Peer, message: Message) -> None:
        if "outcome" in message:
            self._judge(message["outcome"])
        elif "alone" in message:
            # (The health loop runs here: decode computed these prompts on purpose.)
            for url, tokens in dict(message["alone"]).items():
                instance = self.backends.decode.find(str(url))
                if instance is not None:
                    instance.alone_tokens += float(tokens)
        elif "change" in message:
            change = message["change"]
            _apply(self.backends, change, "supervisor")
            self.checks.check_health()  # an added instance is checked at once
            for peer in self._peers():
                if peer is not origin:
                    peer.send({"change": change})
            origin.send({"done": message.get("id")})  # written after the others' copies

    def _judge(self, outcome: dict[str, Any]) -> None:
        pool = self.backends.pool(str(outcome.get("pool")))
        instance = pool.find(str(outcome.get("url"))) if pool is not None else None
        if pool is None or instance is None:
            return  # gone from the pools meanwhile
        # (health only: each worker ejects outliers by its own legs)
        if outcome.get("failure") is None:
            pool.record_success(instance, leg=False)
        else:
            pool.record_failure(instance, str(outcome["failure"]), leg=False)

    def _health_changed(self, instance: Instance) -> None:
        self._send_all({"health": [instance.health()]})

    def _send_all(self, message: Message) -> None:
        for peer in self._peers():
            peer.send(message)


# -- the worker's side -------------------------------------------------------


class _Wire(WireProtocol):
    def __init__(self, link: SupervisorLink) -> None:
        self._link = link
        self._lines = Lines(link.received)

    def dataReceived(self, data: bytes) -> None:
        self._lines.feed(data)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self._link.lost()


class SupervisorLink(Service):
    """In a worker: its pools follow the supervisor's; it stops when the supervisor is gone.

    Without the second part a supervisor that was killed would leave its
    workers serving the shared port with nobody to restart, reload or stop them.
    """

    name = "supervisor-link"

    def __init__(self, reactor: Any, backends: BackendService) -> None:
        self._reactor = reactor
        self.backends = backends
        #: Who applies the configuration the supervisor reloaded (``on_reloaded``).
        self._reloaded: list[Callable[[ProxyConfig], object]] = []
        self._wire: _Wire | None = None
        self._io: StandardIO | None = None
        self._waiting: dict[int, Deferred[None]] = {}
        self._next_id = 0
        #: What the supervisor's discovery last said of its sources (``discovery.report``).
        self.told = HeardReport()
        self._telling: LoopingCall | None = None

    def on_reloaded(self, apply: Callable[[ProxyConfig], object]) -> None:
        """``apply(config)`` with each configuration the supervisor reloaded (the worker's
        tree, ``ProxyService.reconfigure``, which is made after the link it serves through)."""
        self._reloaded.append(apply)

    def startService(self) -> None:
        super().startService()
        for pool in self.backends.pools():
            pool.report = self.report
        self._reactor.callWhenRunning(self._connect)
        self._telling = LoopingCall(self.tell_alone)
        self._telling.clock = self._reactor
        self._telling.start(1.0, now=False)

    def _connect(self) -> None:
        self._wire = _Wire(self)
        # (mypy reads the Windows signature; a worker is POSIX, whose takes the fds.)
        self._io = StandardIO(  # type: ignore[call-arg]
            self._wire, stdin=FROM_SUPERVISOR, stdout=TO_SUPERVISOR, reactor=self._reactor
        )

    def _send(self, message: Message) -> None:
        if self._io is not None:
            self._io.write(encode(message))

    def report(self, role: str, url: str, failure: str | None) -> None:
        """A leg's outcome, for the supervisor to judge."""
        self._send({"outcome": {"pool": role, "url": url, "failure": failure}})

    def tell_alone(self) -> None:
        """The decode-only prompt tokens this worker sent each decode instance since it last
        said (``backends.recompute`` judges in the supervisor)."""
        alone = {}
        for instance in self.backends.decode.instances:
            if instance.alone_tokens:
                alone[instance.url], instance.alone_tokens = instance.alone_tokens, 0.0
        if alone:
            self._send({"alone": alone})

    def publish(self, change: dict[str, str]) -> Deferred[None]:
        """An admin API change made here; fires once every worker has it."""
        self._next_id += 1
        done: Deferred[None] = Deferred()
        self._waiting[self._next_id] = done
        self._send({"change": change, "id": self._next_id})
        return done

    def received(self, message: Message) -> None:
        if "health" in message:
            for health in message["health"]:
                pool = self.backends.pool(str(health.get("pool")))
                if pool is not None:
                    pool.adopt(health)
        elif "config" in message:
            try:
                config = ProxyConfig.from_json(message["config"])
            except (ConfigError, ValueError, KeyError) as error:
                log.error(
                    "a configuration from the supervisor could not be used: {error}",
                    error=str(error),
                )
                return
            for apply in self._reloaded:
                apply(config)
            log.info("configuration reloaded from the supervisor")
        elif "change" in message:
            _apply(self.backends, message["change"], "worker")
        elif "discovered" in message:
            found = message["discovered"]
            urls = tuple(str(url) for url in found["urls"])
            retire = bool(found.get("retire"))
            self.backends.discovered(str(found["pool"]), str(found["source"]), urls, retire)
        elif "sources" in message:
            self.told.told(list(message["sources"]), list(message.get("errors") or []))
        elif "done" in message:
            waiting = self._waiting.pop(message["done"], None)
            if waiting is not None:
                waiting.callback(None)

    def lost(self) -> None:
        self._io = None
        for waiting in self._waiting.values():
            waiting.callback(None)  # nobody left to tell: the change stands here
        self._waiting.clear()
        if self.running:
            log.warn("the supervisor is gone: stopping this worker")
            os.kill(os.getpid(), signal.SIGTERM)  # the one way a proxy stops (signals.py)

    def stopService(self) -> None:
        super().stopService()
        if self._telling is not None and self._telling.running:
            self._telling.stop()
        for pool in self.backends.pools():
            pool.report = None
