"""What the real-process tests share: a twistd spawned outside the tree, and its helpers."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.testing import TwistdProtocol, spawn_twistd
from nixl_twisted.testing.process import WatchedProcess
from tests.support import ProxyCase


def installed_env(more: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without PYTHONPATH: run outside the tree, the installed package serves."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (more or {})


class TwistdCase(ProxyCase):
    timeout = 60

    def spawn(
        self, *args: str, twistd_args: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> TwistdProtocol:
        """``twistd nixlproxy ARGS``; ``env``: more environment variables for it."""
        # Outside the source tree: the installed package and plugin serve.
        process = spawn_twistd(
            reactor,
            args,
            env=installed_env(env),
            path=tempfile.gettempdir(),
            twistd_args=twistd_args,
        )

        def stop_if_running(_: Any = None) -> Deferred[int | None]:
            if not process.ended.called:
                process.transport.signalProcess("KILL")  # type: ignore[union-attr]
            return process.ended

        self.addCleanup(lambda: stop_if_running().addErrback(lambda _: None))
        return process

    def spawn_fakes(self, *args: str) -> WatchedProcess:
        """``python -m nixl_twisted.testing ARGS``, killed at the end if still running."""
        process = WatchedProcess()
        command = [sys.executable, "-m", "nixl_twisted.testing", *args]
        reactor.spawnProcess(
            process,
            command[0],
            command,
            env=installed_env({"PYTHONUNBUFFERED": "1"}),
            path=tempfile.gettempdir(),
        )

        def stop_if_running() -> Deferred[int | None]:
            if not process.ended.called:
                process.transport.signalProcess("KILL")  # type: ignore[union-attr]
            return process.ended

        self.addCleanup(lambda: stop_if_running().addErrback(lambda _: None))
        return process

    async def spawn_workers(self, *args: str) -> tuple[TwistdProtocol, str]:
        """``--workers 2`` on loopback, once both listen; and the address they share."""
        process = self.spawn("--listen", "tcp:0:interface=127.0.0.1", "--workers", "2", *args)
        # Each worker's own line: with --metrics-listen one worker alone says two.
        for worker in (b"[worker 0 ", b"[worker 1 "):
            await process.said(worker + b"nixlproxy.lifecycle#info] nixlproxy listening on")
        match = re.search(rb"workers share (\S+)", process.output)
        assert match is not None, process.output
        return process, match.group(1).decode()

    def config_file(self, decode: str, path: str | None = None, more: str = "") -> str:
        """A --config file with the fake prefill and this decode URL (rewritten at ``path``)."""
        path = path or os.path.join(tempfile.mkdtemp(), "nixlproxy.toml")
        with open(path, "w", encoding="utf-8") as file:
            file.write(f'prefill = ["{self.prefill.url}"]\ndecode = ["{decode}"]\n{more}')
        return path

    def spawn_keyed(self, keys: str, twistd_args: Sequence[str] = ()) -> TwistdProtocol:
        """``twistd nixlproxy`` on loopback before the fakes, its clients' keys in ``keys``."""
        pools = ("--prefill", self.prefill.url, "--decode", self.decode.url)
        listen = ("--listen", "tcp:0:interface=127.0.0.1")
        return self.spawn(*listen, *pools, "--api-keys-file", keys, twistd_args=twistd_args)

    def keys_file(self, text: str, mode: int = 0o644, group: int = -1) -> str:
        """An --api-keys-file holding ``text``, in a directory any user may enter."""
        where = tempfile.mkdtemp(prefix="nixlproxy-keys-")
        self.addCleanup(shutil.rmtree, where)
        os.chmod(where, 0o755)
        path = os.path.join(where, "keys")
        self.rewrite_keys(path, text, mode, group)
        return path

    def rewrite_keys(self, path: str, text: str, mode: int = 0o644, group: int = -1) -> None:
        """``text`` written whole beside ``path``, then renamed into place (docs/security.md)."""
        written = path + ".new"
        with open(written, "w", encoding="utf-8") as file:
            file.write(text)
        os.chown(written, -1, group)
        os.chmod(written, mode)
        os.replace(written, path)

    async def revoke_by_sighup(
        self, process: TwistdProtocol, url: str, keys: str, mode: int = 0o644, group: int = -1
    ) -> None:
        """``sk-old`` taken out of ``keys`` and ``sk-new`` put in, SIGHUP sent: only the new
        one serves once the proxy says it read the file again."""
        self.assertEqual(await self.status_with_key(url, "sk-old"), 200)
        self.rewrite_keys(keys, "sk-new team-b\n", mode, group)
        os.kill(process.transport.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await process.said(f"SIGHUP: no --config file; --api-keys-file {keys} read again".encode())
        self.assertEqual(await self.status_with_key(url, "sk-old"), 401)
        self.assertEqual(await self.status_with_key(url, "sk-new"), 200)

    async def status_with_key(self, url: str, key: str) -> int:
        """``GET /v1/models`` with the client key ``key``: 401 when it is not in effect."""
        headers: dict[bytes | str, bytes | str] = {"Authorization": f"Bearer {key}"}
        response = await self.http.get(url + "/v1/models", headers=headers)
        await response.content()
        return response.code

    async def terminate(self, process: TwistdProtocol) -> None:
        """SIGTERM: the proxy drains, stops its services and exits 0."""
        os.kill(process.transport.pid, signal.SIGTERM)  # type: ignore[union-attr]
        code = await process.ended
        self.assertEqual(code, 0, process.output.decode())
        self.assertIn(b"SIGTERM: draining", process.output)
        self.assertIn(b"Server Shut Down.", process.output)
        self.assertNotIn(b"Traceback", process.output)

    def fresh_connections(self) -> HTTPClient:
        """A client whose every request is a new connection: the kernel picks a worker each time."""
        return HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
