"""A real ``dnsmasq`` on loopback, for tests of DNS discovery against a real resolver.

Started as a user starts a small resolver for a handful of names: no
upstream (``--no-resolv``), the names from a hosts file (``--addn-hosts``),
nothing else read (``--conf-file=/dev/null``, ``--no-hosts``), on a free
loopback port, in the foreground, logging to stderr. Such a dnsmasq answers
A from the file and refuses (REFUSED) what it does not know, AAAA included;
``--local=/DOMAIN/`` (``options``) makes it answer "no such name" instead.
Ready once it says it read the file (no polling); the names change with
:meth:`Dnsmasq.set_hosts` (the file rewritten, SIGHUP, awaited the same way);
stopped with SIGTERM. As root it keeps the user it runs as (``--user``): it
would become ``nobody``, who cannot read the test's private directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from nixl_twisted.testing.process import ServerProcess, WatchedProcess

#: Where Debian's dnsmasq-base puts it, off an ordinary user's PATH.
SBIN = "/usr/sbin:/sbin:/usr/local/sbin"

#: Tries at a port free for both UDP and TCP (dnsmasq serves both).
PORT_ATTEMPTS = 20


class DnsmasqMissing(Exception):
    """No ``dnsmasq`` on the PATH nor in /usr/sbin (``make test`` installs it)."""


def dnsmasq_command() -> str | None:
    """The ``dnsmasq`` binary: on the PATH, else where Debian installs it."""
    return shutil.which("dnsmasq") or shutil.which("dnsmasq", path=SBIN)


def _free_port() -> int:
    """A loopback port no UDP nor TCP socket holds now."""
    for _ in range(PORT_ATTEMPTS):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port: int = udp.getsockname()[1]
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no loopback port free for UDP and TCP in {PORT_ATTEMPTS} tries")


def hosts_text(names: Mapping[str, Sequence[str]]) -> str:
    """A hosts file: one line per address, with the names that have it."""
    by_address: dict[str, list[str]] = {}
    for name, addresses in names.items():
        for address in addresses:
            by_address.setdefault(address, []).append(name)
    return "".join(f"{address} {' '.join(n)}\n" for address, n in by_address.items())


class Dnsmasq(ServerProcess):
    """One ``dnsmasq`` on 127.0.0.1, its names from a hosts file, started by a test."""

    def __init__(
        self,
        reactor: Any,
        names: Mapping[str, Sequence[str]] | None = None,
        options: Sequence[str] = (),
    ) -> None:
        """``names``: each name's addresses (IPv4 or IPv6); ``options``: more of dnsmasq's
        own (``--srv-host=_http._tcp.NAME,TARGET,PORT``, ``--local=/test/``)."""
        self.reactor = reactor
        self.port = _free_port()
        #: ``"127.0.0.1:PORT"``: what ``--dns-server`` takes.
        self.address = f"127.0.0.1:{self.port}"
        self.options = tuple(options)
        super().__init__("nixlproxy-dnsmasq-")
        self.hosts_file = os.path.join(self._dir, "hosts")
        self._write(names or {})
        self._reads = 0

    def command(self, binary: str) -> list[str]:
        """The command line, as a user would type it."""
        return [
            binary,
            "--keep-in-foreground",
            "--log-facility=-",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.hosts_file}",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--pid-file",  # (none)
            f"--user={pwd.getpwuid(os.geteuid()).pw_name}",
            *self.options,
        ]

    async def start(self) -> None:
        """Start it; returns once it has read its hosts file (its sockets are bound before)."""
        binary = dnsmasq_command()
        if binary is None:
            raise DnsmasqMissing("dnsmasq is not installed (make test installs dnsmasq-base)")
        process = self.process = WatchedProcess()
        self.reactor.spawnProcess(process, binary, self.command(binary), env={}, path=self._dir)
        await self._read(process)

    async def set_hosts(self, names: Mapping[str, Sequence[str]]) -> None:
        """Answer with these names from now on: returns once dnsmasq has read them."""
        process = self.process
        if process is None:
            raise RuntimeError("dnsmasq is not running")
        self._write(names)
        process.transport.signalProcess("HUP")  # type: ignore[union-attr]
        await self._read(process)

    def _write(self, names: Mapping[str, Sequence[str]]) -> None:
        # Written aside and renamed: dnsmasq never reads half a file.
        aside = self.hosts_file + ".new"
        with open(aside, "w") as out:
            out.write(hosts_text(names))
        os.replace(aside, self.hosts_file)

    async def _read(self, process: WatchedProcess) -> None:
        """Wait for its next line about the hosts file: "read FILE - N names" or a failure."""
        self._reads += 1
        marker = self.hosts_file.encode()
        said = process.said(marker, self._reads)

        def exited(result: object) -> object:
            if not said.called:
                said.errback(RuntimeError("dnsmasq exited: " + _text(process)))
            return result

        process.ended.addBoth(exited)
        await said
        line = [x for x in process.output.split(b"\n") if marker in x][self._reads - 1]
        if b"read " + marker not in line:
            raise RuntimeError("dnsmasq could not read its hosts file: " + line.decode())


def _text(process: WatchedProcess) -> str:
    return process.output.decode(errors="replace")
