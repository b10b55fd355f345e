"""A real ``redis-server`` on loopback, for tests of ``--limits-redis``.

Started on a free port with nothing saved to disk, ready once it says it
accepts connections (no polling), stopped with SIGTERM; started again on
the same port, it is the same address with an empty memory. Options of
``redis-server``'s own are passed on (``("--maxclients", "1")``,
``("--requirepass", "secret")``), to make it refuse a client as it would.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Sequence
from typing import Any

from nixl_twisted.testing.process import ServerProcess, WatchedProcess

READY = b"Ready to accept connections"


class RedisMissing(Exception):
    """No ``redis-server`` on the PATH (``make test`` installs it)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer(ServerProcess):
    """One ``redis-server`` process on 127.0.0.1, started and stopped by a test."""

    def __init__(self, reactor: Any, options: Sequence[str] = ()) -> None:
        self.reactor = reactor
        self.options = list(options)
        self.port = _free_port()
        super().__init__("nixlproxy-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Start it; returns once it accepts connections."""
        command = shutil.which("redis-server")
        if command is None:
            raise RedisMissing("redis-server is not installed (make test installs it)")
        process = self.process = WatchedProcess()
        args = [command, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self._dir, *self.options]
        self.reactor.spawnProcess(process, command, args, env={}, path=self._dir)
        ready = process.said(READY)

        def exited(result: object) -> object:
            if not ready.called:
                ready.errback(_exited(process))
            return result

        process.ended.addBoth(exited)
        await ready


def _exited(process: WatchedProcess) -> Exception:
    return RuntimeError("redis-server exited: " + process.output.decode(errors="replace"))
