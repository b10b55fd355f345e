"""Health checks over real connections: one kept open per instance, check after check.

Instances dying and coming back, retries and readiness are proved in memory
(``tests/memory/test_health.py``).
"""

from __future__ import annotations

from twisted.internet import reactor

from nixl_twisted.testing import start_proxy
from tests.support import ProxyCase


class HealthConnectionTests(ProxyCase):
    async def test_health_checks_reuse_their_connection(self) -> None:
        await self.start()
        await self.proxy.stop()
        # Real time here: legs' connections idle out after 50 ms, checks come every 200 ms.
        self.proxy = start_proxy(
            [self.prefill.url],
            [self.decode.url],
            listen="tcp:0:interface=127.0.0.1",
            clock=reactor,
            health_interval=0.2,
            backend_idle_timeout=0.05,
        )
        self.addCleanup(self.proxy.stop)
        for _ in range(4):
            await self.decode.next_health_check()
        self.assertGreaterEqual(self.decode.health_checks, 4)
        self.assertEqual(self.decode.site.connections_accepted, 1)
