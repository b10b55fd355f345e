"""``--workers N``: N proxy processes sharing each TCP port, supervised by the parent.

Each worker is a whole ``twistd nixlproxy`` with its own pools, health state
and metrics, listening with ``SO_REUSEPORT`` so that the kernel spreads new
connections among them. The parent keeps every port reserved, restarts a
worker that dies, and on SIGTERM passes the signal on and waits for all of
them to drain.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IListeningPort, IStreamServerEndpoint
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

log = Logger()

TWISTD = (sys.executable, "-c", "from twisted.scripts.twistd import run; run()")
RESTART_DELAY = 1.0


def tcp_address(endpoint: IStreamServerEndpoint) -> tuple[str, int] | None:
    """The (interface, port) of a plain TCP server endpoint, else None."""
    if isinstance(endpoint, TCP4ServerEndpoint | TCP6ServerEndpoint):
        return endpoint._interface or "", endpoint._port  # Twisted keeps no public accessor
    return None


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

    def listen(self, factory: Any) -> Deferred[IListeningPort]:
        sock = _socket(self.host, self.port)
        sock.listen(self.backlog)
        sock.setblocking(False)
        try:
            port = self.reactor.adoptStreamPort(sock.fileno(), sock.family, factory)
        finally:
            sock.close()  # the reactor holds its own duplicate
        return succeed(port)


def reserve(addresses: Sequence[tuple[str, int]]) -> list[socket.socket]:
    """Bind (without listening) each address, resolving port 0 to a real port."""
    return [_socket(host, port) for host, port in addresses]


def worker_args(args: Sequence[str], reserved: Sequence[socket.socket]) -> list[str]:
    """A worker's ``nixlproxy`` arguments: the parent's, its ports made explicit."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("--workers", "--listen"):
            skip = True
            continue
        if arg.startswith(("--workers=", "--listen=")):
            continue
        kept.append(arg)
    for sock in reserved:
        host, port = sock.getsockname()[:2]
        interface = f":interface={host}" if host not in ("0.0.0.0", "::") else ""
        kept += ["--listen", f"tcp:{port}{interface}"]
    return [*kept, "--reuse-port"]


class _Worker(ProcessProtocol):
    def __init__(self, supervisor: WorkerSupervisor, number: int) -> None:
        self.supervisor = supervisor
        self.number = number
        self.ended: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        log.info(
            "worker {number} started, pid {pid}",
            number=self.number,
            pid=self.transport.pid,  # type: ignore[union-attr]
        )

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)
        self.supervisor.ended(self, reason)


class WorkerSupervisor(Service):
    """Starts N workers, restarts those that die, and stops them all together."""

    def __init__(
        self, args: Sequence[str], count: int, reserved: list[socket.socket], reactor: Any = None
    ) -> None:
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.reactor = reactor
        self.args = list(args)
        self.count = count
        self.reserved = reserved
        self.workers: dict[int, _Worker] = {}

    def startService(self) -> None:
        super().startService()
        for number in range(self.count):
            self._spawn(number)

    def _spawn(self, number: int) -> None:
        if not self.running:
            return
        worker = _Worker(self, number)
        self.workers[number] = worker
        self.reactor.spawnProcess(
            worker,
            sys.executable,
            [*TWISTD, "-n", "--pidfile=", "--logfile=-", "nixlproxy", *self.args],
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

    def pids(self) -> list[int]:
        return [w.transport.pid for w in self.workers.values() if w.transport is not None]

    def stopService(self) -> Deferred[Any]:
        """SIGTERM every worker (each drains) and wait for all of them."""
        super().stopService()
        waiting = [w.ended for w in self.workers.values()]
        for worker in list(self.workers.values()):
            with contextlib.suppress(ProcessExitedAlready):
                worker.transport.signalProcess("TERM")  # type: ignore[union-attr]
        stopped = DeferredList(waiting)

        def release_ports(result: object) -> object:
            for sock in self.reserved:
                sock.close()
            return result

        return stopped.addBoth(release_ports)


def take_sigterm(reactor: Any) -> None:
    """Stop the reactor on SIGTERM without twistd re-raising it: exit 0 after a drain."""

    def on_sigterm(signum: int, frame: Any) -> None:
        log.info("SIGTERM: draining requests in flight, then stopping")
        reactor.callFromThread(reactor.stop)

    signal.signal(signal.SIGTERM, on_sigterm)
