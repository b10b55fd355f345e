"""The backend client's shortcuts send what treq itself would have sent."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from http.cookiejar import DefaultCookiePolicy
from io import BytesIO
from pathlib import Path

from hyperlink import EncodedURL
from hypothesis import given
from hypothesis import strategies as st
from treq import content
from treq.client import HTTPClient
from treq.cookies import IndexableCookieJar
from twisted.internet import reactor, ssl
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase
from twisted.web.client import (
    Agent,
    BrowserLikePolicyForHTTPS,
    FileBodyProducer,
    HTTPConnectionPool,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from twisted.web.resource import EncodingResourceWrapper
from twisted.web.server import GzipEncoderFactory

from nixl_twisted.backends.upstream import Upstream, backend_agent, encoded_url, read_body
from nixl_twisted.testing import FakeVLLM, TransferLedger
from tests.loopback.test_tls import self_signed
from tests.support import CHAT, ProxyCase

_HOSTS = st.sampled_from(["127.0.0.1", "decode-0.vllm.svc", "bücher.example"])
_PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/health"])
_QUERIES = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="#"), max_size=20)


class BackendURLTests(TestCase):
    @given(
        scheme=st.sampled_from(["http", "https"]),
        host=_HOSTS,
        port=st.integers(1, 65535),
        path=_PATHS,
        query=_QUERIES,
    )
    def test_same_uri_as_treq_would_send(
        self, scheme: str, host: str, port: int, path: str, query: str
    ) -> None:
        text = f"{scheme}://{host}:{port}{path}" + (f"?{query}" if query else "")
        expected = EncodedURL.from_text(text).to_uri().to_text()
        ready = encoded_url(text)
        self.assertEqual(ready.to_uri().to_text(), expected)
        self.assertEqual(ready.to_text(), expected)

    def test_an_ipv6_literal_host_is_kept_as_it_is(self) -> None:
        # hyperlink's to_uri() alone fails on it (python-hyper/hyperlink#68).
        ready = encoded_url("http://[fd00::1]:8000/v1/completions?q=\u00e9")
        self.assertEqual(ready.to_text(), "http://[fd00::1]:8000/v1/completions?q=%C3%A9")

    def test_a_derived_url_is_rendered_afresh(self) -> None:
        derived = encoded_url("http://127.0.0.1:8000/v1/completions").replace(path=("health",))
        self.assertEqual(derived.to_uri().to_text(), "http://127.0.0.1:8000/health")


class UpstreamTests(TestCase):
    async def test_https_backend_with_its_own_trust(self) -> None:
        directory = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, directory)
        cert, key = self_signed(directory)
        fake = FakeVLLM(name="decode-tls")
        url = await fake.listen(f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}")
        self.addCleanup(fake.stop)
        self.assertTrue(url.startswith("https://"))
        trust = ssl.Certificate.loadPEM(cert.read_bytes())
        connections = HTTPConnectionPool(reactor)
        tls = BrowserLikePolicyForHTTPS(trust)
        upstream = Upstream(backend_agent(reactor, connections, 10.0, tls), connections)
        self.addCleanup(upstream.close)
        body = json.dumps({**CHAT, "kv_transfer_params": None}).encode()
        headers = Headers({b"Content-Type": [b"application/json"]})
        for _ in range(2):  # the second call reuses the endpoint and the connection
            response = await upstream.post(url + "/v1/chat/completions", body, headers)
            self.assertEqual(response.code, 200)
            answer = json.loads(await read_body(response))
            self.assertEqual(answer["object"], "chat.completion")
        self.assertEqual(fake.site.connections_accepted, 1)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


class IPv6BackendTests(ProxyCase):
    if not _has_ipv6_loopback():
        skip = "no IPv6 loopback on this machine"

    async def test_a_completion_through_backends_on_ipv6_literals(self) -> None:
        ledger = TransferLedger()
        prefill = FakeVLLM(name="prefill-v6", ledger=ledger)
        decode = FakeVLLM(name="decode-v6", ledger=ledger)
        for fake in (prefill, decode):
            url = await fake.listen(r"tcp6:0:interface=\:\:1")
            self.addCleanup(fake.stop)
            self.assertTrue(url.startswith("http://[::1]:"), url)
        self.clock = Clock()
        proxy = self.start_proxy([prefill.url], [decode.url])
        http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        response = await http.post(proxy.url + "/v1/chat/completions", json=CHAT)
        answer = await response.json()
        self.assertEqual(response.code, 200)
        self.assertEqual(answer["object"], "chat.completion")
        self.assertEqual((len(prefill.requests), len(decode.requests)), (1, 1))
        # Decode redeemed exactly what prefill issued (the fakes check it).
        self.assertEqual((len(ledger.redeemed), ledger.issued), (1, {}))


class CookieTests(ProxyCase):
    async def test_a_backend_cookie_is_relayed_never_kept(self) -> None:
        await self.start(extra_headers={"Set-Cookie": "session=abc; Path=/"})
        # A client that keeps no cookie either: any Cookie a backend sees is the proxy's.
        client = HTTPClient(
            self.agent, cookiejar=IndexableCookieJar(DefaultCookiePolicy(allowed_domains=[]))
        )
        for _ in range(2):
            response = await client.post(self.proxy.url + "/v1/chat/completions", json=CHAT)
            self.assertEqual(response.code, 200)
            self.assertEqual(
                response.headers.getRawHeaders(b"set-cookie"), [b"session=abc; Path=/"]
            )
            await response.content()
        sent = [r.headers.getRawHeaders(b"cookie") for r in self.prefills[0].requests]
        sent += [r.headers.getRawHeaders(b"cookie") for r in self.decodes[0].requests]
        self.assertEqual(sent, [None] * 4)


class AcceptEncodingTests(ProxyCase):
    """Every leg asks for gzip, whatever the client asked; the client gets identity."""

    async def ask(self, url: str, accept_encoding: bytes | None) -> tuple[IResponse, bytes]:
        """POST the chat body with exactly this ``Accept-Encoding`` (or none)."""
        # A bare Agent, not treq: treq adds an Accept-Encoding of its own.
        headers = Headers({b"Content-Type": [b"application/json"]})
        if accept_encoding is not None:
            headers.setRawHeaders(b"Accept-Encoding", [accept_encoding])
        body = FileBodyProducer(BytesIO(json.dumps(CHAT).encode("utf-8")))
        response = await self.agent.request(b"POST", url.encode("ascii"), headers, body)
        return response, await content(response)

    async def test_the_client_encoding_is_not_forwarded_each_leg_asks_for_gzip(self) -> None:
        await self.start()
        for accepted in (b"br", None):
            response, body = await self.ask(self.proxy.url + "/v1/chat/completions", accepted)
            self.assertEqual((response.code, json.loads(body)["object"]), (200, "chat.completion"))
        legs = [*self.prefill.requests, *self.decode.requests]
        self.assertEqual(
            [leg.headers.getRawHeaders(b"accept-encoding") for leg in legs], [[b"gzip"]] * 4
        )

    async def test_a_gzip_answer_is_decoded_and_the_client_gets_identity(self) -> None:
        await self.start()
        for fake in (self.prefill, self.decode):
            fake.site.resource = EncodingResourceWrapper(fake.resource(), [GzipEncoderFactory()])
        # The backends really answer gzip to what a leg asks for.
        direct, _ = await self.ask(self.decode.url + "/v1/chat/completions", b"gzip")
        self.assertEqual(direct.headers.getRawHeaders(b"content-encoding"), [b"gzip"])

        response, body = await self.ask(self.proxy.url + "/v1/chat/completions", b"br")
        self.assertEqual((response.code, json.loads(body)["object"]), (200, "chat.completion"))
        self.assertIsNone(response.headers.getRawHeaders(b"content-encoding"))
        self.assertEqual(len(self.ledger.redeemed), 1)
