"""``--workers 2`` with a DNS-discovered pool: the supervisor resolves, both workers follow."""

from __future__ import annotations

import json
import os
import signal

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
        # A name is asked again only when its source is made again (here: a reload that
        # changes its refresh), never by the clock, so the queries are counted exactly
        # however slowly the workers start.
        member = "dnssrv+http://_http._tcp.decode.test"
        rest = f'dns-server = "{dns.address}"\ndns-max-refresh = 300\n'
        config = self.config_file(member, more=rest + "dns-min-refresh = 300\n")
        process, address = await self.spawn_workers("--config", config)
        # The supervisor and each worker say the change, once each.
        await process.said(f"decode: +{first.url} (dnssrv+".encode(), times=3)
        both_ports = [("d.test", ports[0]), ("d.test", ports[1])]
        dns.set_services("_http._tcp.decode.test", both_ports)
        self.config_file(member, config, rest + "dns-min-refresh = 299\n")
        os.kill(process.transport.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await process.said(f"decode: +{second.url} (dnssrv+".encode(), times=3)
        # Asked by the supervisor alone: once at start, once at the reload.
        self.assertEqual(dns.queries.count(("_http._tcp.decode.test", "SRV")), 2)

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
