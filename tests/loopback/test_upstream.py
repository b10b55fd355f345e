"""The backend client over real sockets: an https backend with its own trust, IPv6 literals.

Its URL shortcut is proved pure (``tests/pure/test_backend_urls.py``); cookies
and gzip in memory (``tests/memory/test_upstream.py``).
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from pathlib import Path

from treq.client import HTTPClient
from twisted.internet import reactor, ssl
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase
from twisted.web.client import (
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    ResponseFailed,
)
from twisted.web.http_headers import Headers

from nixl_twisted.backends.connections import MAX_HEADER_LINES, HeadTooLarge
from nixl_twisted.backends.upstream import Upstream, backend_agent, read_body
from nixl_twisted.testing import FakeVLLM, TransferLedger
from tests.loopback.test_tls import self_signed
from tests.support import CHAT, ProxyCase


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


class ResponseHeadTests(ProxyCase):
    """A backend's answer with more headers than the proxy reads fails its leg (Twisted's
    parser held 100,000 of them, 52 MB, and the proxy relayed them)."""

    async def test_an_answer_past_the_header_bound_fails_and_one_within_it_is_read(self) -> None:
        fake = FakeVLLM(name="decode-heady")
        url = await fake.listen()
        self.addCleanup(fake.stop)
        connections = HTTPConnectionPool(reactor)
        upstream = Upstream(backend_agent(reactor, connections, 10.0), connections)
        self.addCleanup(upstream.close)
        body = json.dumps({**CHAT, "kv_transfer_params": None}).encode()
        headers = Headers({b"Content-Type": [b"application/json"]})
        fake.extra_headers.update({f"x-h{i}": "v" for i in range(MAX_HEADER_LINES - 10)})
        response = await upstream.post(url + "/v1/chat/completions", body, headers)
        self.assertEqual(response.code, 200)
        await read_body(response)
        fake.extra_headers.update({f"x-h{i}": "v" for i in range(100_000)})
        with self.assertRaises(ResponseFailed) as caught:
            await upstream.post(url + "/v1/chat/completions", body, headers)
        (reason,) = caught.exception.reasons
        self.assertTrue(reason.check(HeadTooLarge), reason)

    async def test_a_decode_answering_100000_headers_is_a_502(self) -> None:
        await self.start()
        self.decodes[0].extra_headers.update({f"x-h{i}": "v" for i in range(100_000)})
        response = await self.post("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 502)
        self.assertFalse(response.headers.hasHeader(b"x-h1"))
        error = json.loads(await response.content())["error"]
        self.assertEqual(error["code"], "decode_unreachable")  # (the leg's failure, logged why)
