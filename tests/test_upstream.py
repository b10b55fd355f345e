"""The backend client's shortcuts send what treq itself would have sent."""

from __future__ import annotations

import json
import shutil
import tempfile
from http.cookiejar import DefaultCookiePolicy
from pathlib import Path

from hyperlink import EncodedURL
from hypothesis import given
from hypothesis import strategies as st
from treq.client import HTTPClient
from treq.cookies import IndexableCookieJar
from twisted.internet import reactor, ssl
from twisted.trial.unittest import TestCase
from twisted.web.client import BrowserLikePolicyForHTTPS
from twisted.web.http_headers import Headers

from nixl_twisted.testing import FakeVLLM
from nixl_twisted.upstream import Upstream, backend_url, read_body
from tests.support import CHAT, ProxyCase
from tests.test_tls import self_signed

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
        ready = backend_url(text)
        self.assertEqual(ready.to_uri().to_text(), expected)
        self.assertEqual(ready.to_text(), expected)

    def test_a_derived_url_is_rendered_afresh(self) -> None:
        derived = backend_url("http://127.0.0.1:8000/v1/completions").replace(path=("health",))
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
        upstream = Upstream(reactor, tls=BrowserLikePolicyForHTTPS(trust))
        self.addCleanup(upstream.close)
        body = json.dumps({**CHAT, "kv_transfer_params": None}).encode()
        headers = Headers({b"Content-Type": [b"application/json"]})
        for _ in range(2):  # the second call reuses the endpoint and the connection
            response = await upstream.post(url + "/v1/chat/completions", body, headers)
            self.assertEqual(response.code, 200)
            answer = json.loads(await read_body(response))
            self.assertEqual(answer["object"], "chat.completion")
        self.assertEqual(fake.site.connections_accepted, 1)


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
