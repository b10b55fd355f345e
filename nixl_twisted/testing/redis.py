"""A real ``redis-server`` on loopback, for tests of ``--limits-redis``.

Started on a free port with nothing saved to disk, ready once it says it
accepts connections (no polling), stopped with SIGTERM; started again on
the same port, it is the same address with an empty memory. Options of
``redis-server``'s own are passed on (``("--maxclients", "1")``,
``("--requirepass", "secret")``), to make it refuse a client as it would. With
``tls_for=NAME`` it also listens for TLS, with a self-signed certificate for NAME (an IP
address or a DNS name) made in its directory: ``tls_url`` trusts that certificate alone.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
from collections.abc import Sequence
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

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

    def __init__(
        self, reactor: Any, options: Sequence[str] = (), tls_for: str | None = None
    ) -> None:
        self.reactor = reactor
        self.options = list(options)
        self.port = _free_port()
        super().__init__("nixlproxy-redis-")
        self.tls_port = 0
        if tls_for is not None:
            self.tls_port = _free_port()
            cert, key = self.certificate = self_signed(self._dir, tls_for)
            self.options += ["--tls-port", str(self.tls_port), "--tls-cert-file", cert]
            self.options += ["--tls-key-file", key, "--tls-ca-cert-file", cert]
            self.options += ["--tls-auth-clients", "no"]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def tls_url(self) -> str:
        """Its TLS port's URL, trusting its own certificate (``ssl_ca_certs``)."""
        return f"rediss://127.0.0.1:{self.tls_port}/0?ssl_ca_certs={self.certificate[0]}"

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


def self_signed(directory: str, name: str) -> tuple[str, str]:
    """A self-signed certificate for ``name`` (an IP address or a DNS name) and its key,
    written as PEM files in ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    try:
        alternative: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        alternative = x509.DNSName(name)
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([alternative]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as out:
        out.write(certificate.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


def _exited(process: WatchedProcess) -> Exception:
    return RuntimeError("redis-server exited: " + process.output.decode(errors="replace"))
