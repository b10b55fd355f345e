"""``--workers N``: N proxy processes sharing each TCP port, supervised by the parent.

Each worker is a whole ``twistd nixlproxy`` with its own pools, health state
and metrics, listening with ``SO_REUSEPORT`` so that the kernel spreads new
connections among them. The parent binds every port first (so ``tcp:0``
becomes one real port for all), hands each worker its resolved
``ProxyConfig`` as JSON on standard input, restarts a worker that dies,
passes SIGHUP on (each worker reloads its pools), and on SIGTERM passes the
signal on and waits for all of them to drain. A worker whose supervisor is
gone (its standard input closed) stops by itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.error import ConnectionDone, ProcessExitedAlready
from twisted.internet.interfaces import (
    IListeningPort,
    IProtocolFactory,
    IReadDescriptor,
    IStreamServerEndpoint,
)
from twisted.internet.main import CONNECTION_DONE
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import ILogObserver, Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from nixl_twisted import logs
from nixl_twisted.config import ConfigError, ProxyConfig
from nixl_twisted.settings import tcp_address, tcp_endpoint
from nixl_twisted.signals import SignalService

log = Logger()

#: ``twistd`` run by this very interpreter, wherever its script was installed.
TWISTD = (sys.executable, "-c", "from twisted.scripts.twistd import run; run()")
RESTART_DELAY = 1.0


def _socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@implementer(IStreamServerEndpoint)
class ReusePortEndpoint:
    """A TCP endpoint whose socket shares its port with the other workers."""

    def __init__(self, reactor: Any, host: str, port: int, backlog: int = 1024) -> None:
        self.reactor = reactor
        self.host = host
        self.port = port
        self.backlog = backlog

    def listen(self, factory: IProtocolFactory) -> Deferred[IListeningPort]:
        sock = _socket(self.host, self.port)  # a bind error is raised here, at once
        sock.listen(self.backlog)
        sock.setblocking(False)
        try:
            port = self.reactor.adoptStreamPort(sock.fileno(), sock.family, factory)
        finally:
            sock.close()  # the reactor holds its own duplicate
        return succeed(port)


class _Worker(ProcessProtocol):
    def __init__(self, supervisor: WorkerSupervisor, number: int, config: str) -> None:
        self.supervisor = supervisor
        self.number = number
        self.config = config
        self.ended: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        # One line of configuration; the pipe then stays open: its end tells
        # the worker that this supervisor is gone, however it went.
        self.transport.write(self.config.encode("utf-8") + b"\n")
        log.info("worker {number} started, pid {pid}", number=self.number, pid=self.transport.pid)

    def signal(self, name: str) -> None:
        with contextlib.suppress(ProcessExitedAlready):
            self.transport.signalProcess(name)  # type: ignore[union-attr]

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)
        self.supervisor.ended(self, reason)


class WorkerSupervisor(Service):
    """Binds the shared ports, starts N workers, restarts those that die, stops them all."""

    name = "workers"

    def __init__(self, config: ProxyConfig, reactor: Any) -> None:
        self.config = config
        self.reactor = reactor
        self.workers: dict[int, _Worker] = {}
        self._reserved: list[socket.socket] = []
        self._listen: tuple[str, ...] = ()

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        addresses = [tcp_address(description) for description in self.config.listen]
        self._reserved = [_socket(*address) for address in addresses if address is not None]
        shared = [sock.getsockname()[:2] for sock in self._reserved]
        for host, port in shared:
            log.info("nixlproxy workers share {host}:{port}", host=host, port=port)
        self._listen = tuple(tcp_endpoint(host, port) for host, port in shared)

    def startService(self) -> None:
        if not self._reserved:
            self.privilegedStartService()
        super().startService()
        # Once the reactor runs: a worker that is up can be told to stop.
        self.reactor.callWhenRunning(self._spawn_all)

    def _spawn_all(self) -> None:
        for number in range(self.config.workers):
            self._spawn(number)

    def _spawn(self, number: int) -> None:
        if not self.running:
            return
        config = self.config.for_worker(number, self._listen)
        worker = _Worker(self, number, config.to_json())
        self.workers[number] = worker
        self.reactor.spawnProcess(
            worker,
            sys.executable,
            [*TWISTD, "-n", "--pidfile=", "--logfile=-", "nixlproxy", "--worker", str(number)],
            env=dict(os.environ),
            childFDs={0: "w", 1: 1, 2: 2},
        )

    def ended(self, worker: _Worker, reason: Failure) -> None:
        if self.workers.get(worker.number) is worker:
            del self.workers[worker.number]
        if self.running:
            log.error(
                "worker {number} ended unexpectedly ({reason}); restarting it",
                number=worker.number,
                reason=reason.getErrorMessage(),
            )
            self.reactor.callLater(RESTART_DELAY, self._spawn, worker.number)

    def hangup(self) -> None:
        """SIGHUP: every worker reloads its pools; a restarted one gets them too."""
        try:
            self.config = self.config.reloaded()
        except ConfigError as error:
            log.error("SIGHUP: {error} (the workers keep their pools too)", error=str(error))
        for worker in self.workers.values():
            worker.signal("HUP")
        log.info("SIGHUP: passed on to {count} workers", count=len(self.workers))

    def stopService(self) -> Deferred[Any]:
        """SIGTERM every worker (each drains) and wait for all of them."""
        super().stopService()
        waiting = [w.ended for w in self.workers.values()]
        for worker in list(self.workers.values()):
            worker.signal("TERM")

        def release_ports(result: object) -> object:
            for sock in self._reserved:
                sock.close()
            return result

        return DeferredList(waiting).addBoth(release_ports)


@implementer(IReadDescriptor)
class _SupervisorPipe:
    """A worker's standard input: the supervisor's end of it closes when it exits."""

    def __init__(self, gone: Callable[[], None]) -> None:
        self._gone = gone

    def fileno(self) -> int:
        return 0

    # An exception, as Twisted's own descriptors return (the interface says Failure).
    def doRead(self) -> ConnectionDone | None:  # type: ignore[override]
        return None if os.read(0, 4096) else CONNECTION_DONE

    def connectionLost(self, reason: Failure) -> None:
        self._gone()

    def logPrefix(self) -> str:
        return "supervisor"


class SupervisorWatch(Service):
    """In a worker: stop, as SIGTERM would (drain, exit 0), once the supervisor is gone.

    Without it a supervisor that was killed leaves its workers serving the
    shared port with nobody to restart, reload or stop them.
    """

    name = "supervisor-watch"

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def startService(self) -> None:
        super().startService()
        self._reactor.callWhenRunning(self._reactor.addReader, _SupervisorPipe(self._gone))

    def _gone(self) -> None:
        if self.running:
            log.warn("the supervisor is gone: stopping this worker")
            os.kill(os.getpid(), signal.SIGTERM)  # the one way a proxy stops (signals.py)


class SupervisorService(MultiService):
    """The parent of ``--workers``: the supervisor and the signals it takes."""

    def __init__(
        self, config: ProxyConfig, supervisor: WorkerSupervisor, signals: Service | None
    ) -> None:
        super().__init__()
        self.config = config
        self.supervisor = supervisor
        if signals is not None:  # first: its handlers go in before any worker is spawned
            signals.setServiceParent(self)
        supervisor.setServiceParent(self)

    #: What ``twistd nixlproxy`` offers its application (``nixl_twisted.logs``).
    log_observer: ILogObserver | None = None

    def setServiceParent(self, parent: Any) -> None:
        super().setServiceParent(parent)
        logs.offer(parent, self.log_observer)


def supervise(config: ProxyConfig, reactor: Any, take_signals: bool = True) -> SupervisorService:
    """The service tree of a ``--workers`` parent."""
    supervisor = WorkerSupervisor(config, reactor)
    signals = SignalService(reactor, supervisor.hangup) if take_signals else None
    return SupervisorService(config, supervisor, signals)
