"""``--workers 2`` with a DNS-discovered pool: the supervisor resolves, both workers follow."""

from __future__ import annotations

import json

from nixl_twisted.testing import FakeDns
from tests.process.support import TwistdCase
from tests.support import CHAT


class DiscoveryUnderWorkersTests(TwistdCase):
    async def test_both_workers_serve_the_membership_the_supervisor_discovered(self) -> None:
        await self.start(decodes=2)
        dns = FakeDns(ttl=1)
        await dns.listen()
        self.addCleanup(dns.stop)
        first, second = self.decodes
        ports = [int(fake.url.rsplit(":", 1)[1]) for fake in self.decodes]
        dns.set_addresses("d.test", ["127.0.0.1"])
        dns.set_services("_http._tcp.decode.test", [("d.test", ports[0])])
        process, address = await self.spawn_workers(
            "--prefill",
            self.prefill.url,
            "--decode",
            "dnssrv+http://_http._tcp.decode.test",
            "--dns-server",
            dns.address,
        )
        # The supervisor and each worker say the change, once each.
        await process.said(f"decode: +{first.url} (dnssrv+".encode(), times=3)
        # The new answer lives long (its next refresh is --dns-max-refresh away): the count
        # below cannot race a third refresh on a slow machine.
        dns.set_addresses("d.test", ["127.0.0.1"], ttl=300)
        both_ports = [("d.test", ports[0]), ("d.test", ports[1])]
        dns.set_services("_http._tcp.decode.test", both_ports, ttl=300)
        await process.said(f"decode: +{second.url} (dnssrv+".encode(), times=3)
        self.assertEqual(dns.queries.count(("_http._tcp.decode.test", "SRV")), 2)  # once each

        http = self.fresh_connections()
        seen: dict[int, list[tuple[str, str]]] = {}
        for _ in range(20):
            response = await http.post(f"http://{address}/v1/chat/completions", json=CHAT)
            self.assertEqual(response.code, 200)
            await response.content()
            health = json.loads(await (await http.get(f"http://{address}/healthcheck")).content())
            seen[health["pid"]] = sorted(
                (i["url"], i["source"]) for i in health["instances"]["decode"]
            )
        self.assertEqual(len(seen), 2)  # both workers answered
        both = sorted((fake.url, "dnssrv") for fake in self.decodes)
        self.assertEqual(list(seen.values()), [both, both])
        # Each worker alternates between the two: the one that served more gave each >= 5.
        self.assertEqual(len(first.requests) + len(second.requests), 20)
        self.assertGreaterEqual(min(len(first.requests), len(second.requests)), 5)
        await self.terminate(process)
