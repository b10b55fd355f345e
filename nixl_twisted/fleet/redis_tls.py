"""TLS for a ``rediss://`` URL, verified: the server's certificate is checked against the
system's trust store (or the CAs of the URL's ``ssl_ca_certs``) and the URL's host name
before the proxy says a word to it.

txredisapi's own ``ssl_context_factory=True`` checks no certificate, so the proxy gives it
a connection creator of Twisted's (``optionsForClientTLS``) instead, and holds each Redis
protocol's greeting (``AUTH``, ``SELECT``, ``SUBSCRIBE``) until the handshake is done: a
password is never sent to a server whose certificate was refused, and the refusal is said
in words (certificate verify failed, name mismatch), not retried in silence.
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from OpenSSL import SSL
from service_identity import VerificationError
from twisted.internet import reactor, ssl
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IDelayedCall, IHandshakeListener, IReactorTime
from twisted.python.failure import Failure
from zope.interface import implementer

from nixl_twisted.config.tenants import redis_ca_file

#: Seconds a TLS handshake may go unanswered before the connection is closed.
HANDSHAKE = 1.0
_PEM_END = "-----END CERTIFICATE-----"


def connection_creator(url: str) -> Any:
    """The TLS connection creator for ``url`` (``None`` for ``redis://``): the server's
    certificate checked for the URL's host against the system's trust store, or the CA
    certificates of the PEM file ``ssl_ca_certs`` names."""
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        return None
    host = parts.hostname or "127.0.0.1"
    ca_file = dict(parse_qsl(parts.query)).get("ssl_ca_certs")
    if ca_file is None:
        return ssl.optionsForClientTLS(host, trustRoot=ssl.platformTrust())
    pem = redis_ca_file(ca_file)
    certificates = [
        ssl.Certificate.loadPEM((block + _PEM_END).encode())
        for block in pem.split(_PEM_END)
        if "-----BEGIN CERTIFICATE-----" in block
    ]
    return ssl.optionsForClientTLS(host, trustRoot=ssl.trustRootFromCertificates(certificates))


def endpoint(url: str, connect_timeout: float, on: Any = None) -> Any:
    """The endpoint for ``url``: TCP on the reactor ``on`` (the proxy's; None: txredisapi's
    global one), wrapped in verified TLS for ``rediss://``. On the proxy's reactor, a proxy built on
    a test's reactor makes no real connection that outlives it."""
    txredisapi = importlib.import_module("txredisapi")
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    if on is None:
        return txredisapi._makeEndpoint(host, port, connect_timeout, connection_creator(url))
    tcp = HostnameEndpoint(on, host, port, timeout=connect_timeout)
    creator = connection_creator(url)
    return tcp if creator is None else txredisapi._TLSEndpoint(tcp, creator)


def tls_failure(reason: Failure, host: str) -> str | None:
    """Why a TLS connection to ``host`` failed, in words (``None``: not for TLS)."""
    if reason.check(VerificationError):
        return f"TLS: the server's certificate is not for {host} (name mismatch)"
    if reason.check(SSL.Error):
        errors = reason.value.args[0] if reason.value and reason.value.args else []
        causes = [str(each[2]) for each in errors if isinstance(each, tuple) and len(each) == 3]
        return f"TLS with {host} failed: {'; '.join(causes) or reason.getErrorMessage()}"
    return None


def verified(protocol: type, host: str, clock: IReactorTime | None = None) -> type:
    """``protocol`` (a txredisapi one) that greets Redis only once the TLS handshake has
    checked the certificate, and tells ``refused_by_tls(why)`` when it did not."""
    timer: IReactorTime = clock or reactor

    @implementer(IHandshakeListener)
    class Verified(protocol):
        _silent: IDelayedCall | None = None
        _verified = False

        def connectionMade(self) -> None:
            self._silent = timer.callLater(HANDSHAKE, self._no_handshake)

        def handshakeCompleted(self) -> None:
            self._verified = True
            self._stop_waiting()
            super().connectionMade()

        def connectionLost(self, why: Failure) -> None:
            if not self._verified and self._silent is not None:
                lost = f"TLS with {host}: the connection closed before the handshake ended"
                self.refused_by_tls(tls_failure(why, host) or lost)
            self._stop_waiting()
            super().connectionLost(why)

        def refused_by_tls(self, why: str) -> None:
            """Told why the handshake failed (by default, nothing: the link says it)."""

        def _no_handshake(self) -> None:
            self._silent = None
            self.refused_by_tls(f"TLS with {host}: no handshake within {HANDSHAKE:g} s")
            self.transport.abortConnection()

        def _stop_waiting(self) -> None:
            if self._silent is not None and self._silent.active():
                self._silent.cancel()
            self._silent = None

    Verified.__name__ = f"Verified{protocol.__name__}"
    return Verified
