"""DNS discovery against a real dnsmasq, started as a user would: no upstream, a hosts file.

Such a dnsmasq answers A from its file and refuses AAAA (and every name it
does not know): each query counts on its own, the log says what failed in
words, and Twisted Names' per-query lines stay out of it.
"""

from __future__ import annotations

import json
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.logger import LogLevel, PredicateResult, formatEvent
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.logs import LogLevels
from nixl_twisted.testing import FakeVLLM, TransferLedger
from tests.support import CHAT, DiscoveryCase, real_dnsmasq

#: What Twisted Names logs for each UDP query, unless told otherwise.
CHATTER = ("DNSDatagramProtocol", "UDP Port", "Starting protocol", "Stopping protocol")


class DnsmasqDiscoveryTests(DiscoveryCase):
    async def fake(self, name: str, interface: str = "127.0.0.1", port: int = 0) -> FakeVLLM:
        fake = FakeVLLM(name=name, ledger=self.ledger)
        await fake.listen(f"tcp:{port}:interface={interface}")
        self.addCleanup(fake.stop)
        return fake

    async def sources(self) -> dict[str, dict[str, Any]]:
        response = await self.http.get(self.proxy.url + "/healthcheck")
        health = json.loads(await response.content())
        return {s["pool"]: s for s in health["sources"]}

    async def chat(self) -> int:
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        return int(response.code)

    async def test_a_name_dnsmasq_answers_only_for_ipv4_is_the_pool_and_said_in_words(
        self,
    ) -> None:
        self.ledger, self.clock = TransferLedger(), Clock()
        self.http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        first = await self.fake("decode-1")
        port = int(first.url.rsplit(":", 1)[1])
        second = await self.fake("decode-2", "127.0.0.2", port)
        prefill = await self.fake("prefill")
        prefill_port = int(prefill.url.rsplit(":", 1)[1])
        names = {"decode.test": ["127.0.0.1", "127.0.0.2"], "p0.test": ["127.0.0.1"]}
        dnsmasq = await real_dnsmasq(
            self, names, [f"--srv-host=_http._tcp.prefill.test,p0.test,{prefill_port}"]
        )
        events = self.logged()
        decode = f"dns+http://decode.test:{port}"
        self.proxy = self.start_proxy(
            ["dnssrv+http://_http._tcp.prefill.test"], [decode], dns_server=dnsmasq.address
        )
        await self.until(
            lambda: (len(self.serving("decode")), len(self.serving("prefill"))) == (2, 1)
        )
        self.assertEqual(self.serving("decode"), sorted([first.url, second.url]))
        self.assertEqual(self.serving("prefill"), [prefill.url])
        self.assertEqual([await self.chat() for _ in range(4)], [200] * 4)
        self.assertEqual((len(first.requests), len(second.requests)), (2, 2))
        sources = await self.sources()
        self.assertEqual((sources["decode"]["state"], sources["decode"]["errors"]), ("ok", 0))
        refused = "AAAA query for decode.test refused by the server (REFUSED)"
        self.assertEqual(sources["decode"]["last_error"], refused)
        self.assertEqual(
            sources["prefill"]["last_error"],
            "AAAA query for p0.test refused by the server (REFUSED)",
        )

        # Asked again as the names change: the refused AAAA is said once, not each time.
        await dnsmasq.set_hosts({"decode.test": ["127.0.0.1"], "p0.test": ["127.0.0.1"]})
        changed = self.discovery().changed()
        self.clock.advance(1)  # (dnsmasq's hosts-file TTL is 0: the least refresh)
        await changed
        self.assertEqual(self.serving("decode"), [first.url])
        await dnsmasq.set_hosts(names)
        changed = self.discovery().changed()
        self.clock.advance(1)
        await changed
        self.assertEqual(len(self.serving("decode")), 2)

        # A name dnsmasq no longer knows: A refused too, so the name fails and keeps its own.
        await dnsmasq.set_hosts({"p0.test": ["127.0.0.1"]})
        noticed = self.discovery().noticed()
        self.clock.advance(1)
        await noticed
        sources = await self.sources()
        self.assertEqual(sources["decode"]["state"], "failing")
        both = f"A query for decode.test refused by the server (REFUSED); {refused}"
        self.assertEqual(sources["decode"]["last_error"], both)
        self.assertEqual(len(self.serving("decode")), 2)
        self.assertEqual(await self.chat(), 200)

        # The log, as the proxy's own --log-level info filter passes it.
        levels = LogLevels("info")
        shown = [formatEvent(e) for e in events if levels(e) is not PredicateResult.no]
        self.assertEqual(
            [line for line in shown if refused in line],
            [
                f"decode: {decode}: {refused}; the queries that answered are used, and what "
                "the failed ones last gave",
                f"decode: {decode} failed, keeping its 2 known instances: {both}",
            ],
        )
        self.assertEqual([line for line in shown if "<Message" in line or "rCode" in line], [])
        self.assertEqual([line for line in shown if any(c in line for c in CHATTER)], [])
        # (Twisted Names did open a port for each query: its lines went to debug.)
        quiet = [e for e in events if "DNSDatagramProtocol starting on" in formatEvent(e)]
        self.assertTrue(quiet)
        self.assertEqual(
            {(e["log_level"], e["log_namespace"]) for e in quiet},
            {(LogLevel.debug, "twisted.names")},
        )
