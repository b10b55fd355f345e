"""``--listen ssl:...`` serves the proxy over TLS with no code of its own."""

from __future__ import annotations

import datetime
import ipaddress
import json
import shutil
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from treq.client import HTTPClient
from twisted.internet import reactor, ssl
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool

from tests.support import CHAT, ProxyCase, sse_events


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, written as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class TLSTests(ProxyCase):
    async def test_streams_over_tls(self) -> None:
        await self.start(tokens=3)
        directory = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, directory)
        cert, key = self_signed(directory)
        proxy = self.start_proxy_on(f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}")
        trust = ssl.Certificate.loadPEM(cert.read_bytes())
        pool = HTTPConnectionPool(reactor)
        self.addCleanup(pool.closeCachedConnections)
        http = HTTPClient(
            Agent(reactor, contextFactory=BrowserLikePolicyForHTTPS(trust), pool=pool)
        )
        url = proxy.url.replace("http://", "https://")
        response = await http.post(
            url + "/v1/chat/completions", json=dict(CHAT, stream=True), unbuffered=True
        )
        self.assertEqual(response.code, 200)
        events = sse_events(await response.content())
        self.assertEqual(events[-1], "[DONE]")
        health = await http.get(url + "/healthcheck")
        self.assertTrue(json.loads(await health.content())["ready"])
