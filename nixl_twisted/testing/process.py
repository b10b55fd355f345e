"""A real ``twistd nixlproxy`` process, and where it listens.

One way to start it and learn its address, for the demo and the benchmark
(:class:`Twistd`, blocking, for scripts) and for trial tests
(:class:`TwistdProtocol`, on the reactor). Both run ``twistd`` with this
very interpreter and read the address from the proxy's own log line,
``nixlproxy listening on ADDRESS`` (text) or its ``address`` field (JSON).
:class:`WatchedProcess`, what ``TwistdProtocol`` is without the proxy's
address, watches any other child process (``python -m nixl_twisted.testing``);
:class:`ServerProcess` is a real server's (``redis``, ``dnsmasq``).
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, cast

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from nixl_twisted.run.workers import TWISTD

_LISTENING = re.compile(
    rb'nixlproxy listening on (?:http://)?(?P<text>[^\s{"]+)|"address": ?"(?P<json>[^"]+)"'
)


def twistd_command(
    args: Sequence[str], twistd_args: Sequence[str] = (), twistd: Sequence[str] = TWISTD
) -> list[str]:
    """``twistd -n nixlproxy ARGS`` in the foreground, no pid file, logging to stdout.

    ``twistd``: the command that runs twistd; by default this very interpreter's
    (another virtualenv's ``bin/twistd`` runs the proxy installed there).
    """
    return [*twistd, "-n", "--pidfile=", "--logfile=-", *twistd_args, "nixlproxy", *args]


def listening_addresses(output: bytes) -> list[str]:
    """Every address the proxy said it listens on, in order."""
    return [(m["text"] or m["json"]).decode() for m in _LISTENING.finditer(output)]


def terminate(process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM, then wait; killed if it does not exit within ``timeout``: its exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


class TwistdFailed(RuntimeError):
    """The process did not start listening (its output says why)."""


class ProcessExited(RuntimeError):
    """The process ended before it wrote the line awaited (its output says why)."""


class Twistd:
    """``twistd nixlproxy`` as a child process, for scripts (blocking)."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        twistd_args: Sequence[str] = (),
        prefix: Sequence[str] = (),
        twistd: Sequence[str] = TWISTD,
        cwd: str | None = None,
    ) -> None:
        """``prefix`` runs before the command (the benchmark pins it: ``taskset -c 0``);
        ``twistd``: as ``twistd_command`` takes it; ``cwd``: where it runs (twistd puts
        its working directory on ``sys.path``: outside a source tree, the installed
        package serves)."""
        self.process = subprocess.Popen(
            [*prefix, *twistd_command(args, twistd_args, twistd)],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1"),
        )
        self.output = b""
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in cast(IO[bytes], self.process.stdout):
            self._lines.put(line)
        self._lines.put(None)

    def address(self, count: int = 1, timeout: float = 30.0) -> str:
        """Wait until the proxy has said it listens ``count`` times; its first address."""
        deadline = time.monotonic() + timeout
        while len(listening_addresses(self.output)) < count:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TwistdFailed("timed out waiting to listen:\n" + self.text()) from None
            if line is None:
                raise TwistdFailed("exited before it listened:\n" + self.text())
            self.output += line
        return listening_addresses(self.output)[0]

    def text(self) -> str:
        return self.output.decode("utf-8", "replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the proxy drains), then wait; killed if it does not exit in time."""
        return terminate(self.process, timeout)


class WatchedProcess(ProcessProtocol):
    """A child process on the reactor: what it wrote (stdout and stderr), awaited
    by marker or by line with no polling, and its exit."""

    def __init__(self) -> None:
        self.output = b""
        self.ended: Deferred[int | None] = Deferred()
        self.signal: int | None = None
        self._markers: list[tuple[bytes, int, Deferred[None]]] = []
        self._lines: list[tuple[bytes, Deferred[bytes]]] = []

    def said(self, marker: bytes, times: int = 1) -> Deferred[None]:
        """Fires once the process has written ``marker`` ``times`` times."""
        waiting: Deferred[None] = Deferred()
        if self.output.count(marker) >= times:
            waiting.callback(None)
        else:
            self._markers.append((marker, times, waiting))
        return waiting

    def line_with(self, marker: bytes) -> Deferred[bytes]:
        """Fires with the first whole line (its newline left off) that contains ``marker``.

        A marker alone may arrive before the rest of its line: this waits for the line's end.
        """
        waiting: Deferred[bytes] = Deferred()
        self._lines.append((marker, waiting))
        self._wake()
        return waiting

    async def terminate(self) -> None:
        """SIGTERM, unless it has ended; returns once it has exited."""
        if self.ended.called:
            return
        exited: Deferred[int | None] = Deferred()
        self.ended.addBoth(exited.callback)
        self.transport.signalProcess("TERM")  # type: ignore[union-attr]
        await exited

    def outReceived(self, data: bytes) -> None:
        self.output += data
        self._heard()
        self._wake()

    errReceived = outReceived

    def _heard(self) -> None:
        """What a subclass learns from the output so far, before markers are woken."""

    def _wake(self) -> None:
        ready = [m for m in self._markers if self.output.count(m[0]) >= m[1]]
        self._markers = [m for m in self._markers if m not in ready]
        for _, _, waiting in ready:
            waiting.callback(None)
        if not self._lines:
            return
        whole = self.output.rpartition(b"\n")[0].split(b"\n")
        found = [(w, next((x for x in whole if w[0] in x), None)) for w in self._lines]
        self._lines = [w for w, line in found if line is None]
        for (_, reader), line in found:
            if line is not None:
                reader.callback(line)

    def processEnded(self, reason: Failure) -> None:
        for _, waiting in self._lines:
            waiting.errback(ProcessExited(self.output.decode(errors="replace")))
        self._lines = []
        if reason.check(ProcessDone, ProcessTerminated):
            ended = cast(ProcessTerminated, reason.value)
            self.signal = ended.signal
            self.ended.callback(ended.exitCode)
        else:
            self.ended.errback(reason)


class ServerProcess:
    """A real server a test runs (redis-server, dnsmasq): its process, and a directory of
    its own that goes with it."""

    def __init__(self, prefix: str) -> None:
        self.process: WatchedProcess | None = None
        self._dir = tempfile.mkdtemp(prefix=prefix)

    async def stop(self) -> None:
        """Stop it (SIGTERM); returns once it has exited."""
        process, self.process = self.process, None
        if process is not None:
            await process.terminate()

    async def cleanup(self) -> None:
        await self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


class TwistdProtocol(WatchedProcess):
    """``twistd nixlproxy`` spawned on the reactor: where it listens, what it said, its exit."""

    def __init__(self) -> None:
        super().__init__()
        self.listening: Deferred[str] = Deferred()

    def _heard(self) -> None:
        addresses = listening_addresses(self.output)
        if addresses and not self.listening.called:
            self.listening.callback(addresses[0])

    def processEnded(self, reason: Failure) -> None:
        if not self.listening.called:
            self.listening.errback(TwistdFailed(self.output.decode(errors="replace")))
        super().processEnded(reason)


def spawn_twistd(
    reactor: object,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    path: str | None = None,
    twistd_args: Sequence[str] = (),
) -> TwistdProtocol:
    """Start ``twistd nixlproxy ARGS`` on ``reactor`` (an ``IReactorProcess``)."""
    process = TwistdProtocol()
    command = twistd_command(args, twistd_args)
    reactor.spawnProcess(  # type: ignore[attr-defined]
        process, command[0], command, env=dict(env if env is not None else os.environ), path=path
    )
    return process
