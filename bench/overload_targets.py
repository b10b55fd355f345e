"""What serves the fakes in ``bench.overload``: a real ``twistd nixlproxy``, or vllm-project/router.

Each is a child process pinned to core 0 (this process moves off it),
started anew for each load, its output read line by line on a thread of
its own so that the lines logged during a load can be counted: from the
load's first request to the first line it writes once told to stop.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, cast

from nixl_twisted.testing.process import listening_addresses, terminate, twistd_command

#: The core the proxy (or the router) runs on; the fakes and the load run on the others.
CORE = "0"


class TargetFailed(RuntimeError):
    """It did not start (what it wrote says why: an option it does not know, say)."""


class Log:
    """A child process, and every line it writes (stdout and stderr together)."""

    def __init__(
        self, command: Sequence[str], ready: Callable[[bytes], str | None], stopping: bytes
    ) -> None:
        """``ready`` finds the URL in the line that says it serves; ``stopping`` is in the
        first line it writes once told to stop."""
        self.command = list(command)
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.lines: list[bytes] = []
        self.url: str | None = None
        self._ready = ready
        self._stopping = stopping
        self._said = threading.Event()
        self._begin = 0
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in cast(IO[bytes], self.process.stdout):
            self.lines.append(line)
            if self.url is None:
                self.url = self._ready(line)
                if self.url is not None:
                    self._said.set()
        self._said.set()  # it ended: whoever waits must stop waiting

    def wait_ready(self, timeout: float = 60.0) -> str:
        self._said.wait(timeout)
        if self.url is None:
            self.stop()
            text = b"".join(self.lines).decode("utf-8", "replace")
            raise TargetFailed(f"{shlex.join(self.command)} did not start:\n{text}")
        return self.url

    def load_begins(self) -> None:
        self._begin = len(self.lines)

    def lines_during_load(self) -> list[bytes]:
        """From ``load_begins`` to the first line that says it is stopping (after ``stop``)."""
        during = self.lines[self._begin :]
        stopped = next((i for i, line in enumerate(during) if self._stopping in line), None)
        return during if stopped is None else during[:stopped]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then wait (killed if it does not exit in time); every line read."""
        terminate(self.process, timeout)
        self._thread.join(timeout)


@dataclass(frozen=True)
class Target:
    """A name to print, and how to start it in front of the fakes' URLs."""

    name: str
    command: Callable[[dict[str, list[str]]], list[str]]
    ready: Callable[[bytes], str | None]
    stopping: bytes

    @contextmanager
    def serving(self, urls: dict[str, list[str]]) -> Iterator[tuple[str, Log]]:
        """It serves the fakes: its URL, and its log (lines counted once it stopped)."""
        _off_core()
        log = Log(_pinned(self.command(urls)), self.ready, self.stopping)
        try:
            url = log.wait_ready()
            _wait_for_port(url)
            yield url, log
        finally:
            log.stop()


def nixlproxy(args: Sequence[str]) -> Target:
    """A real ``twistd nixlproxy`` with ``args`` (its access log on, as by default)."""

    def command(urls: dict[str, list[str]]) -> list[str]:
        pools = [*_each("--prefill", urls["prefill"]), *_each("--decode", urls["decode"])]
        return twistd_command(["--listen", "tcp:0:interface=127.0.0.1", *pools, *args])

    def ready(line: bytes) -> str | None:
        found = listening_addresses(line)
        return f"http://{found[0]}" if found else None

    return Target(f"twistd nixlproxy {' '.join(args)}", command, ready, b"SIGTERM")


def vllm_router(
    path: str, concurrent: int, queue_size: int, queue_timeout: float, args: Sequence[str]
) -> Target:
    """vllm-project/router's binary in P/D mode (NIXL), with its queue: ``concurrent``
    requests at once (its token bucket), ``queue_size`` waiting at most
    ``queue_timeout`` seconds (whole seconds: it takes an integer)."""
    port = _free_port()
    options = [
        *("--max-concurrent-requests", str(concurrent), "--queue-size", str(queue_size)),
        *("--queue-timeout-secs", str(math.ceil(queue_timeout))),
        *args,
    ]

    def command(urls: dict[str, list[str]]) -> list[str]:
        return [
            path,
            "--vllm-pd-disaggregation",
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--prometheus-port", str(_free_port()), "--policy", "round_robin"),
            *_each("--prefill", urls["prefill"]),
            *_each("--decode", urls["decode"]),
            *options,
        ]

    def ready(line: bytes) -> str | None:
        return f"http://127.0.0.1:{port}" if b"Starting server on" in line else None

    name = f"vllm-router (P/D, round_robin) {' '.join(options)}"
    return Target(name, command, ready, b"Received terminate signal")


def _each(option: str, values: Sequence[str]) -> list[str]:
    return [word for value in values for word in (option, value)]


def _pinned(command: Sequence[str]) -> list[str]:
    return ["taskset", "-c", CORE, *command] if shutil.which("taskset") else list(command)


def _off_core() -> None:
    """This process (the load, the sampling, the log readers) never wakes on the target's core."""
    elsewhere = set(range(os.cpu_count() or 2)) - {int(CORE)}
    if elsewhere and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, elsewhere)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_port(url: str, timeout: float = 30.0) -> None:
    """The target said it serves; its socket accepts (the router says so just before)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing accepts connections at {url}")
