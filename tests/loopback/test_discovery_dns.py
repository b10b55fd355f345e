"""DNS discovery against a real DNS server on loopback: ``dns+`` and ``dnssrv+`` pools.

The proxy's clock (a ``Clock``) says when a name is asked again and when a
query times out; the questions and answers are real UDP to ``FakeDns``, the legs real HTTP to
fake vLLMs at the addresses the records give.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.config import ProxyConfig
from nixl_twisted.discovery.dns import QUERY_TIMEOUT
from nixl_twisted.testing import FakeDns, FakeVLLM, TransferLedger
from tests.support import CHAT, ChunkCollector, DiscoveryCase, sse_events


class DnsDiscoveryTests(DiscoveryCase):
    async def begin(self) -> None:
        self.ledger = TransferLedger()
        self.clock = Clock()
        self.dns = FakeDns(ttl=1)
        await self.dns.listen()
        self.addCleanup(self.dns.stop)
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.http = HTTPClient(Agent(reactor, pool=pool))

    async def fakes_on(self, *hosts: str, role: str = "decode") -> list[FakeVLLM]:
        """One fake per address, all on the same port (what an A record set gives)."""
        fakes: list[FakeVLLM] = []
        port = 0
        for host in hosts:
            fake = FakeVLLM(name=f"{role}-{host}", ledger=self.ledger)
            interface = host.replace(":", r"\:")
            kind = "tcp6" if ":" in host else "tcp"
            await fake.listen(f"{kind}:{port}:interface={interface}")
            port = int(fake.url.rsplit(":", 1)[1])
            self.addCleanup(fake.stop)
            fakes.append(fake)
        return fakes

    async def refresh(self, seconds: float = 1.0) -> None:
        """The proxy's clock moves on: names whose refresh is due are asked again."""
        self.clock.advance(seconds)

    async def health(self) -> dict[str, Any]:
        response = await self.http.get(self.proxy.url + "/healthcheck")
        return dict(json.loads(await response.content()))

    async def chat(self) -> int:
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        return int(response.code)

    async def test_a_aaaa_and_srv_records_are_the_pools(self) -> None:
        await self.begin()
        decodes = await self.fakes_on("127.0.0.1", "::1")
        port = decodes[0].url.rsplit(":", 1)[1]
        prefills = [FakeVLLM(name=f"prefill-{i}", ledger=self.ledger) for i in range(2)]
        for fake in prefills:
            await fake.listen()
            self.addCleanup(fake.stop)
        self.dns.set_addresses("decode.test", ["127.0.0.1", "::1"])
        ports = [int(f.url.rsplit(":", 1)[1]) for f in prefills]
        self.dns.set_services(
            "_http._tcp.prefill.test", [("p0.test", ports[0]), ("p1.test", ports[1])]
        )
        self.dns.set_addresses("p0.test", ["127.0.0.1"])
        self.dns.set_addresses("p1.test", ["127.0.0.1"])
        self.proxy = self.start_proxy(
            ["dnssrv+http://_http._tcp.prefill.test"],
            [f"dns+http://decode.test:{port}"],
            dns_server=self.dns.address,
        )
        await self.until(lambda: len(self.serving("prefill")) == len(self.serving("decode")) == 2)
        self.assertEqual(
            self.serving("decode"), [f"http://127.0.0.1:{port}", f"http://[::1]:{port}"]
        )
        self.assertEqual(self.serving("prefill"), sorted(f.url for f in prefills))

        codes = [await self.chat() for _ in range(4)]
        self.assertEqual(codes, [200] * 4)
        self.assertEqual([len(f.requests) for f in decodes], [2, 2])
        self.assertEqual([len(f.requests) for f in prefills], [2, 2])

        health = await self.health()
        self.assertEqual({i["source"] for i in health["instances"]["decode"]}, {"dns"})
        self.assertEqual({i["source"] for i in health["instances"]["prefill"]}, {"dnssrv"})
        self.assertEqual(
            sorted((s["pool"], s["source"], s["state"], s["instances"]) for s in health["sources"]),
            [("decode", "dns", "ok", 2), ("prefill", "dnssrv", "ok", 2)],
        )
        metrics = await self.metrics()
        self.assertEqual(metrics[("nixlproxy_discovered_instances", "decode", "dns")], 2.0)
        self.assertEqual(metrics[("nixlproxy_discovered_instances", "prefill", "dnssrv")], 2.0)

    async def metrics(self) -> dict[tuple[str, str, str], float]:
        response = await self.http.get(self.proxy.url + "/metrics")
        found = {}
        for family in text_string_to_metric_families((await response.content()).decode()):
            for sample in family.samples:
                if "source" in sample.labels:
                    key = (sample.name, sample.labels["pool"], sample.labels["source"])
                    found[key] = float(sample.value)
        return found

    async def test_a_record_added_is_checked_then_used_and_one_removed_drains(self) -> None:
        await self.begin()
        first, second = await self.fakes_on("127.0.0.1", "127.0.0.2")
        port = first.url.rsplit(":", 1)[1]
        prefill = FakeVLLM(name="prefill", ledger=self.ledger)
        await prefill.listen()
        self.addCleanup(prefill.stop)
        self.dns.set_addresses("decode.test", ["127.0.0.1"], ttl=5)
        self.proxy = self.start_proxy(
            [prefill.url],
            [f"dns+http://decode.test:{port}"],
            dns_server=self.dns.address,
            health_interval=60,
        )
        backends = self.proxy.service.backends
        await self.until(lambda: len(self.serving("decode")) == 1)
        await self.proxy.service.checks.check_health()

        # The TTL says when it is asked again: not before 5 s.
        self.dns.set_addresses("decode.test", ["127.0.0.1", "127.0.0.2"], ttl=5)
        asked = self.dns.asked("decode.test")
        self.clock.advance(4.9)
        self.assertFalse(asked.called)
        changed = self.discovery().changed()
        self.clock.advance(0.1)
        await changed
        new = backends.decode.find(second.url)
        assert new is not None
        self.assertEqual(new.state.value, "pending")  # its check is on its way, no leg yet
        await self.proxy.service.checks.check_health()
        self.assertEqual(new.state.value, "up")
        self.assertEqual([await self.chat() for _ in range(4)], [200] * 4)
        self.assertEqual((len(first.requests), len(second.requests)), (2, 2))

        # Removed: a stream in flight to it finishes; no new leg goes there.
        second.hold_streams_after(1)
        first.hold_streams_after(1)
        streams = []
        for fake in (first, second):
            held = fake.stream_held()
            response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))
            collector = ChunkCollector()
            response.deliverBody(collector)
            streams.append(collector)
            await held
        self.dns.set_addresses("decode.test", ["127.0.0.1"], ttl=5)
        changed = self.discovery().changed()
        self.clock.advance(5)
        await changed
        self.assertTrue(new.draining)
        self.assertIn(new, backends.decode.instances)  # until its stream ends
        first.release()
        second.release()
        for collector in streams:
            events = sse_events(b"".join(await collector.done))
            self.assertEqual(events[-1], "[DONE]")
        self.assertNotIn(new, backends.decode.instances)
        self.assertEqual([await self.chat() for _ in range(2)], [200] * 2)
        self.assertEqual((len(first.requests), len(second.requests)), (5, 3))

    async def one_named_decode(self, **settings: Any) -> str:
        """A decode pool of one name with one A record, and a static prefill; its port."""
        await self.begin()
        (decode,) = await self.fakes_on("127.0.0.1")
        port = decode.url.rsplit(":", 1)[1]
        prefill = FakeVLLM(name="prefill", ledger=self.ledger)
        await prefill.listen()
        self.addCleanup(prefill.stop)
        self.dns.set_addresses("decode.test", ["127.0.0.1"])
        self.proxy = self.start_proxy(
            [prefill.url],
            [f"dns+http://decode.test:{port}"],
            dns_server=self.dns.address,
            **settings,
        )
        await self.until(lambda: len(self.serving("decode")) == 1)
        return port

    async def test_errors_keep_the_last_known_instances(self) -> None:
        port = await self.one_named_decode()

        # SERVFAIL: counted and said, the instance kept.
        self.dns.fail("decode.test")
        noticed = self.discovery().noticed()
        self.clock.advance(1)
        await noticed
        (source,) = (await self.health())["sources"]
        self.assertEqual((source["state"], source["errors"]), ("failing", 1))
        self.assertIn(
            "A query for decode.test failed at the server (SERVFAIL)", source["last_error"]
        )
        self.assertEqual(await self.chat(), 200)

        # The server gone: each query times out by the proxy's clock, the instance is kept.
        await self.dns.stop()
        noticed = self.discovery().noticed()
        self.clock.advance(2)  # (the backoff after one failure: asked again, no answer)
        first, then = QUERY_TIMEOUT
        self.clock.advance(first)  # (the first try's timeout: asked once more)
        self.clock.advance(then - 0.5)
        self.assertFalse(noticed.called)  # (not before the last try's timeout)
        self.clock.advance(0.5)
        self.assertTrue(noticed.called)  # (then, with no real time waited)
        (source,) = (await self.health())["sources"]
        self.assertEqual((source["state"], source["errors"]), ("failing", 2))
        self.assertEqual(self.serving("decode"), [f"http://127.0.0.1:{port}"])
        self.assertEqual(await self.chat(), 200)
        metrics = await self.metrics()
        self.assertEqual(metrics[("nixlproxy_discovery_errors_total", "decode", "dns")], 2.0)

    async def test_nxdomain_empties_the_pool_only_after_the_grace_period(self) -> None:
        port = await self.one_named_decode(discovery_grace=10)

        self.dns.remove("decode.test")
        noticed = self.discovery().noticed()
        self.clock.advance(1)
        await noticed
        (source,) = (await self.health())["sources"]
        self.assertEqual(source["state"], "emptying")
        self.assertEqual(await self.chat(), 200)  # still served through the grace

        changed = self.discovery().changed()
        self.clock.advance(10)
        await changed
        self.assertEqual(self.serving("decode"), [])
        self.assertEqual(await self.chat(), 503)
        health = await self.health()
        self.assertFalse(health["ready"])

        self.dns.set_addresses("decode.test", ["127.0.0.1"])
        changed = self.discovery().changed()
        self.clock.advance(30)
        await changed
        self.assertEqual(self.serving("decode"), [f"http://127.0.0.1:{port}"])
        self.assertEqual(await self.chat(), 200)

    async def test_a_reload_that_drops_a_name_drains_only_its_instances(self) -> None:
        await self.begin()
        (found,) = await self.fakes_on("127.0.0.1")
        port = found.url.rsplit(":", 1)[1]
        static = FakeVLLM(name="static", ledger=self.ledger)
        prefill = FakeVLLM(name="prefill", ledger=self.ledger)
        for fake in (static, prefill):
            await fake.listen()
            self.addCleanup(fake.stop)
        self.dns.set_addresses("decode.test", ["127.0.0.1"])
        named = f"dns+http://decode.test:{port}"
        self.proxy = self.start_proxy(
            [prefill.url], [static.url, named], dns_server=self.dns.address
        )
        await self.until(lambda: len(self.serving("decode")) == 2)
        config = self.proxy.service.config

        def reloaded(decode: list[str]) -> ProxyConfig:
            settings = dict(config.settings(), decode=decode)
            return ProxyConfig.from_settings({k: v for k, v in settings.items() if v is not None})

        self.proxy.service.reconfigure(reloaded([static.url]))
        self.assertEqual(self.serving("decode"), [static.url])  # (no leg on it: gone at once)
        self.assertEqual(self.discovery().sources(), [])
        self.proxy.service.reconfigure(reloaded([named]))  # the static one drains, the name is back
        await self.until(lambda: self.serving("decode") == [found.url])
        self.assertEqual([await self.chat() for _ in range(2)], [200, 200])
        self.assertEqual((len(static.requests), len(found.requests)), (0, 2))
