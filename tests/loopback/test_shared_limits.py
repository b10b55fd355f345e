"""``--limits-redis``: two proxies before one real redis-server hold a tenant to one limit,
and each counts alone, saying so once, while Redis is away."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.testing import RunningProxy
from nixl_twisted.web.shared_limits import SharedWindows
from tests.support import CHAT, ProxyCase, real_redis

KEY = "sk-team-a"


class SharedLimitTests(ProxyCase):
    timeout = 20

    async def shared(self, **settings: Any) -> tuple[RunningProxy, RunningProxy]:
        """Redis, the fakes, and two proxies counting team-a's requests in it."""
        self.redis = await real_redis(self)
        where = Path(tempfile.mkdtemp(prefix="nixlproxy-keys-"))
        self.addCleanup(shutil.rmtree, where)
        (where / "keys").write_text(f"{KEY} team-a\n")
        proxy = {"api_keys_file": str(where / "keys"), "limits_redis": self.redis.url, **settings}
        await self.start(tokens=4, proxy=proxy)
        other = self.start_proxy(
            [f.url for f in self.prefills], [f.url for f in self.decodes], **proxy
        )
        for each in (self.proxy, other):
            if not self.windows(each)._factory.size:
                await self.windows(each).connected()
        return self.proxy, other

    def windows(self, proxy: RunningProxy) -> SharedWindows:
        shared = proxy.app.tenancy.shared
        assert shared is not None
        return shared

    async def status(self, proxy: RunningProxy) -> int:
        # A connection of its own: the proxies' clock, moved by a test, times idle ones out.
        client = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        headers: dict[bytes | str, bytes | str] = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {KEY}",
        }
        response = await client.post(
            proxy.url + "/v1/chat/completions", data=json.dumps(CHAT).encode(), headers=headers
        )
        await response.content()
        return int(response.code)

    def fallback(self, proxy: RunningProxy) -> float:
        value = proxy.app.metrics.tenant_limits_fallback._value.get()
        return float(value)

    async def test_two_proxies_hold_a_tenant_to_one_limit(self) -> None:
        one, two = await self.shared(tenant_requests_per_minute=3)
        self.assertEqual([await self.status(p) for p in (one, two, one)], [200, 200, 200])
        self.assertEqual([await self.status(p) for p in (two, one)], [429, 429])
        self.clock.advance(60)  # (both proxies' clocks: the window is theirs, not Redis's)
        self.assertEqual(await self.status(two), 200)
        self.assertEqual((self.fallback(one), self.fallback(two)), (0, 0))

    async def test_a_tenant_with_no_limit_never_waits_for_redis(self) -> None:
        one, _ = await self.shared(tenants={"team-a": {"priority": 1}})
        await self.redis.stop()
        self.assertEqual(await self.status(one), 200)
        self.assertFalse(self.windows(one).fallback)  # (Redis was not asked)

    async def test_tokens_are_shared_with_what_vllm_reported(self) -> None:
        one, two = await self.shared(tenant_tokens_per_minute=8)
        self.assertEqual(await self.status(one), 200)  # (prompt plus 4 tokens: over 8)
        self.assertEqual(await self.status(two), 429)

    async def test_without_redis_each_counts_alone_says_so_once_and_shares_again(self) -> None:
        events = self.logged()
        one, two = await self.shared(tenant_requests_per_minute=2)
        self.assertEqual([await self.status(p) for p in (one, two, one)], [200, 200, 429])
        await self.redis.stop()
        # Served: each proxy now counts alone, from nothing.
        self.assertEqual([await self.status(one) for _ in range(3)], [200, 200, 429])
        self.assertEqual(self.fallback(one), 1)
        warned = [e for e in events if "did not answer" in str(e.get("log_format"))]
        self.assertEqual(len(warned), 1)
        self.assertNotIn(str(self.redis.port) + "/0@", str(warned[0]))
        await self.redis.start()
        await self.windows(one).connected()
        self.clock.advance(60)
        self.assertEqual(await self.status(one), 200)  # (Redis empty again: shared afresh)
        self.assertEqual(self.fallback(one), 0)
        again = [e for e in events if "answers again" in str(e.get("log_format"))]
        self.assertEqual(len(again), 1)

    async def test_the_models_the_proxy_lists_count_as_requests_too(self) -> None:
        one, two = await self.shared(tenant_requests_per_minute=1, health_interval=5)
        for each in (one, two):
            await each.service.backends.check_health()  # (each reads what the fakes serve)
        client = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        headers: dict[bytes | str, bytes | str] = {"Authorization": f"Bearer {KEY}"}
        response = await client.get(one.url + "/v1/models", headers=headers)
        listed = json.loads(await response.content())
        self.assertEqual([card["id"] for card in listed["data"]], ["fake-model"])
        refused = await client.get(two.url + "/v1/models", headers=headers)
        self.assertEqual(refused.code, 429)  # (the other proxy's request counted in Redis)
        self.assertEqual(
            json.loads(await refused.content())["error"]["code"], "rate_limit_exceeded"
        )
        relayed = [r for f in self.decodes for r in f.requests if r.path == "/v1/models"]
        self.assertEqual(relayed, [])  # (the proxy answered from what its checks read)
