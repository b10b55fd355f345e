"""``--workers N``: N proxy processes sharing each TCP port, supervised by the parent.

Each worker is a whole ``twistd nixlproxy`` listening with ``SO_REUSEPORT``
so that the kernel spreads new connections among them. The parent binds
every port first (``tcp:0`` becomes one real port for all, ``--metrics-listen``
included), hands each worker its resolved ``ProxyConfig`` as JSON on standard
input, restarts a worker that dies, and on SIGTERM passes the signal on and
waits for all of them to drain. What makes them one proxy is in
``nixl_twisted.run.coordination`` (pools and health, decided here, over a pipe
to each worker) and in the metrics, which every worker writes to one
``prometheus_client`` multiprocess directory, so that any worker's
``/metrics`` reports the whole proxy. A worker whose supervisor is gone
(its pipe closed) stops by itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import replace
from typing import Any

from prometheus_client.multiprocess import mark_process_dead
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted import logs
from nixl_twisted.backends.checks import HealthChecks
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.endpoints import tcp_address, tcp_endpoint
from nixl_twisted.config.words import counted
from nixl_twisted.discovery.service import Discovery
from nixl_twisted.observe.metrics import METRICS_DIR_ENV
from nixl_twisted.run import startup
from nixl_twisted.run.coordination import (
    FROM_SUPERVISOR,
    TO_SUPERVISOR,
    Coordinator,
    Lines,
    Message,
    encode,
)
from nixl_twisted.run.ports import cannot_listen, shared_socket
from nixl_twisted.run.root import backend_pools, backend_service
from nixl_twisted.run.signals import SignalService
from nixl_twisted.run.tree import Logging, ProcessTree

log = Logger()

#: ``twistd`` run by this very interpreter, wherever its script was installed.
TWISTD = (sys.executable, "-c", "from twisted.scripts.twistd import run; run()")
RESTART_DELAY = 1.0


#: A supervisor's metrics directory is ``nixlproxy-metrics-PID-XXXX`` in the temporary directory.
METRICS_PREFIX = "nixlproxy-metrics-"


def remove_stale_metrics(where: str) -> None:
    """Remove the metrics directories of supervisors that are gone (killed: no stop ran)."""
    for entry in os.scandir(where):
        pid = entry.name.removeprefix(METRICS_PREFIX).split("-", 1)[0]
        if entry.name.startswith(METRICS_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


class _Worker(ProcessProtocol):
    def __init__(self, supervisor: WorkerSupervisor, number: int, config: str) -> None:
        self.supervisor = supervisor
        self.number = number
        self.config = config
        self.ended: Deferred[None] = Deferred()
        self.pid: int | None = None
        self._lines = Lines(lambda message: supervisor.coordinator.received(self, message))

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.pid = self.transport.pid
        # One line of configuration, then the coordination's messages; the
        # pipe stays open: its end tells the worker that this supervisor is gone.
        self.transport.write(self.config.encode("utf-8") + b"\n")
        self.supervisor.coordinator.welcome(self)
        logs.lifecycle.info("worker {number} started, pid {pid}", number=self.number, pid=self.pid)

    def send(self, message: Message) -> None:
        if self.transport is not None:
            self.transport.write(encode(message))

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == TO_SUPERVISOR:
            self._lines.feed(data)

    def signal(self, name: str) -> None:
        with contextlib.suppress(ProcessExitedAlready):
            self.transport.signalProcess(name)  # type: ignore[union-attr]

    def processEnded(self, reason: Failure) -> None:
        self.transport = None
        self.ended.callback(None)
        self.supervisor.ended(self, reason)


class WorkerSupervisor(Service):
    """Binds the shared ports, starts N workers, restarts those that die, stops them all."""

    name = "workers"

    def __init__(
        self, config: ProxyConfig, reactor: Any, backends: BackendService, checks: HealthChecks
    ) -> None:
        self.config = config
        self.reactor = reactor
        self.workers: dict[int, _Worker] = {}
        self.coordinator = Coordinator(backends, checks, lambda: list(self.workers.values()))
        #: The supervisor discovers once, for all: each change goes to every worker.
        self.discovery = Discovery(reactor, reactor, backends, config, self.coordinator)
        self._reserved: list[socket.socket] = []
        self._listen: tuple[str, ...] = ()
        self._metrics_listen: str | None = None
        self._admin_listen: str | None = None
        #: Where every worker's metrics are, for whichever worker is scraped.
        self.metrics_dir: str | None = None

    def _share(self, description: str) -> str:
        address = tcp_address(description)
        assert address is not None, "the configuration allows only tcp: with --workers"
        try:
            sock = shared_socket(*address)
        except OSError as error:
            raise SystemExit(cannot_listen(*address, error)) from None
        self._reserved.append(sock)
        host, port = sock.getsockname()[:2]
        logs.lifecycle.info("nixlproxy workers share {host}:{port}", host=host, port=port)
        return tcp_endpoint(host, port)

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        self._listen = tuple(self._share(description) for description in self.config.listen)
        if self.config.metrics_listen is not None:
            self._metrics_listen = self._share(self.config.metrics_listen)
        if self.config.admin_listen is not None:
            self._admin_listen = self._share(self.config.admin_listen)
        remove_stale_metrics(tempfile.gettempdir())
        self.metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")

    def startService(self) -> None:
        if not self._reserved:
            self.privilegedStartService()
        cannot = self._cannot_run_workers()
        if cannot is not None:  # (after twistd --uid: else no worker would ever start)
            raise SystemExit(f"nixlproxy: --workers as this user: {cannot}")
        startup.check_descriptors(self.config)  # the workers inherit the limit
        startup.announce(self.config)
        super().startService()
        # Once the reactor runs: a worker that is up can be told to stop.
        self.reactor.callWhenRunning(self._spawn_all)

    def _cannot_run_workers(self) -> str | None:
        """Why the user this process now runs as cannot run its workers, or None."""
        if not os.access(sys.executable, os.X_OK):
            return f"cannot run {sys.executable}"
        if self.metrics_dir is not None and not os.access(self.metrics_dir, os.W_OK | os.X_OK):
            return (
                f"cannot write the metrics directory {self.metrics_dir} (made before twistd --uid)"
            )
        return None

    def _spawn_all(self) -> None:
        for number in range(self.config.workers):
            self._spawn(number)

    def _spawn(self, number: int) -> None:
        if not self.running:
            return
        current = replace(self.config, pools=self.coordinator.pools(self.config.pools))
        config = current.for_worker(number, self._listen, self._metrics_listen, self._admin_listen)
        worker = _Worker(self, number, config.to_json())
        self.workers[number] = worker
        assert self.metrics_dir is not None
        self.reactor.spawnProcess(
            worker,
            sys.executable,
            [*TWISTD, "-n", "--pidfile=", "--logfile=-", "nixlproxy", "--worker", str(number)],
            env=dict(os.environ, **{METRICS_DIR_ENV: self.metrics_dir}),
            childFDs={FROM_SUPERVISOR: "w", 1: 1, 2: 2, TO_SUPERVISOR: "r"},
        )

    def ended(self, worker: _Worker, reason: Failure) -> None:
        if self.workers.get(worker.number) is worker:
            del self.workers[worker.number]
        if worker.pid is not None and self.metrics_dir is not None:
            # Its counters stay in the sum; its gauges (in flight) leave it.
            mark_process_dead(worker.pid, self.metrics_dir)
        if self.running:
            log.error(
                "worker {number} ended unexpectedly ({reason}); restarting it",
                number=worker.number,
                reason=reason.getErrorMessage(),
            )
            self.reactor.callLater(RESTART_DELAY, self._spawn, worker.number)

    def reconfigure(self, config: ProxyConfig) -> None:
        """A reload: pools and health checks applied here, each worker sent its configuration."""
        self.config = config
        self.coordinator.backends.configure(config)
        self.coordinator.checks.configure(config)
        self.discovery.configure(config)
        for worker in self.workers.values():
            mine = config.for_worker(
                worker.number, self._listen, self._metrics_listen, self._admin_listen
            )
            worker.send({"config": mine.to_json()})
        self.coordinator.checks.check_health()  # a new instance is checked at once

    def stopService(self) -> Deferred[Any]:
        """SIGTERM every worker (each drains) and wait for all of them."""
        super().stopService()
        waiting = [w.ended for w in self.workers.values()]
        for worker in list(self.workers.values()):
            worker.signal("TERM")

        def release_ports(result: object) -> object:
            for sock in self._reserved:
                sock.close()
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
            return result

        return DeferredList(waiting).addBoth(release_ports)


class SupervisorService(ProcessTree):
    """The parent of ``--workers``: the supervisor, the backends it checks for all, its signals."""

    def __init__(
        self,
        config: ProxyConfig,
        supervisor: WorkerSupervisor,
        reactor: Any,
        take_signals: bool = True,
        logging: Logging | None = None,
    ) -> None:
        super().__init__(config, logging)
        self.supervisor = supervisor
        if take_signals:  # first: its handlers go in before any worker is spawned
            SignalService(reactor, self.reload).setServiceParent(self)
        # Stopped after the workers.
        supervisor.coordinator.backends.setServiceParent(self)
        supervisor.coordinator.checks.setServiceParent(self)
        supervisor.discovery.setServiceParent(self)
        supervisor.setServiceParent(self)

    def reconfigure(self, config: ProxyConfig) -> None:
        self.supervisor.reconfigure(config)
        super().reconfigure(config)

    def reached(self) -> str:
        return f", sent to {counted(len(self.supervisor.workers), 'worker')}"


def supervise(
    config: ProxyConfig, reactor: Any, take_signals: bool = True, logging: Logging | None = None
) -> SupervisorService:
    """The service tree of a ``--workers`` parent: it checks the backends' health for all."""
    backends, checks = backend_service(config, reactor, reactor, backend_pools(config, reactor))
    supervisor = WorkerSupervisor(config, reactor, backends, checks)
    return SupervisorService(config, supervisor, reactor, take_signals, logging)
