"""``--limits-redis``: two proxies before one real redis-server hold a tenant to one limit,
and each counts alone, saying so once in words and counting why, while Redis is away,
refuses the proxy's connection (a real one at its ``maxclients``, or with another
password), or answers garbage or a reply of the wrong shape (``ScriptedRedis``); the
limits are shared again once Redis behaves."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.admission.windows import SharedWindows
from nixl_twisted.fleet.link import RETRY, RedisLink
from nixl_twisted.testing import RunningProxy
from nixl_twisted.testing.resp import OK, ScriptedRedis
from tests.support import CHAT, ProxyCase, real_redis

KEY = "sk-team-a"


class SharedLimitTests(ProxyCase):
    timeout = 20

    async def shared(self, **settings: Any) -> tuple[RunningProxy, RunningProxy]:
        """Redis, the fakes, and two proxies counting team-a's requests in it."""
        self.redis = await real_redis(self)
        await self.limited(self.redis.url, **settings)
        other = self.start_proxy(
            [f.url for f in self.prefills], [f.url for f in self.decodes], **self.settings
        )
        for each in (self.proxy, other):
            if not self.windows(each).link.open:
                await self.windows(each).connected()
        return self.proxy, other

    async def limited(self, url: str, **settings: Any) -> RunningProxy:
        """The fakes, and a proxy counting team-a's requests in the Redis at ``url``
        (its connection not made yet: nothing has run since the proxy started)."""
        where = Path(tempfile.mkdtemp(prefix="nixlproxy-keys-"))
        self.addCleanup(shutil.rmtree, where)
        (where / "keys").write_text(f"{KEY} team-a\n")
        self.settings = {"api_keys_file": str(where / "keys"), "limits_redis": url, **settings}
        await self.start(tokens=4, proxy=self.settings)
        return self.proxy

    async def scripted(self, **settings: Any) -> tuple[ScriptedRedis, RunningProxy]:
        """A raw socket speaking Redis's protocol, and a proxy counting in it."""
        fake = ScriptedRedis(reactor)
        await fake.listen()
        self.addCleanup(fake.stop)
        return fake, await self.limited(fake.url, **settings)

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

    def alone(self, proxy: RunningProxy) -> dict[str, float]:
        """``nixlproxy_tenant_limits_decided_alone_total``, by reason."""
        return {
            sample.labels["reason"]: sample.value
            for family in proxy.app.metrics.registry.collect()
            if family.name == "nixlproxy_tenant_limits_decided_alone"
            for sample in family.samples
            if sample.name.endswith("_total")
        }

    def warned(self, events: list[dict[str, Any]]) -> list[str]:
        """What each warning said Redis did, in order."""
        return [e["what"] for e in events if "counts its own" in str(e.get("log_format"))]

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
        self.assertEqual(sum(self.alone(one).values()), 3)
        warned = [e for e in events if "counts its own" in str(e.get("log_format"))]
        self.assertEqual(len(warned), 1)
        self.assertNotIn(str(self.redis.port) + "/0@", str(warned[0]))
        # (in words: unreached, or unanswered if the proxy had not seen the close yet)
        self.assertRegex(
            warned[0]["what"],
            r"^(could not be reached \(.+\)|did not answer within 100 ms)$",
        )
        await self.redis.start()
        await self.windows(one).connected()
        self.clock.advance(60)
        self.assertEqual(await self.status(one), 200)  # (Redis empty again: shared afresh)
        self.assertEqual(self.fallback(one), 0)
        again = [e for e in events if "limits are shared" in str(e.get("log_format"))]
        self.assertEqual(len(again), 1)

    async def test_the_models_the_proxy_lists_count_as_requests_too(self) -> None:
        one, two = await self.shared(tenant_requests_per_minute=1, health_interval=5)
        for each in (one, two):
            await each.service.checks.check_health()  # (each reads what the fakes serve)
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

    async def test_a_redis_at_its_maxclients_refuses_and_the_limits_come_back(self) -> None:
        events = self.logged()
        self.redis = await real_redis(self, "--maxclients", "1")
        held = await RedisClient.connect(self.redis.port)  # (Redis's one client)
        one = await self.limited(self.redis.url, tenant_requests_per_minute=1)
        refused = await self.windows(one).link.refused()
        self.assertEqual(refused, "SELECT 0 failed: ERR max number of clients reached")
        # Served under this process's own limit (1 a minute), each counted.
        self.assertEqual([await self.status(one) for _ in range(2)], [200, 429])
        self.assertEqual(self.alone(one), {"not_connected": 2})
        self.assertEqual(self.fallback(one), 1)
        self.assertEqual(
            self.warned(events),
            [f"refused the connection ({refused}; tried again every 1 s)"],
        )
        await held.quit()  # (Redis closes it once it has let it go)
        connected = self.windows(one).connected()
        self.clock.advance(RETRY)
        await connected
        # Shared again: Redis, empty, admits one and refuses the next.
        self.assertEqual([await self.status(one) for _ in range(2)], [200, 429])
        self.assertEqual(self.alone(one), {"not_connected": 2})
        self.assertEqual(self.fallback(one), 0)
        self.assertEqual(len(self.warned(events)), 1)
        again = [e for e in events if "limits are shared" in str(e.get("log_format"))]
        self.assertEqual(len(again), 1)

    async def test_a_wrong_password_is_said_in_words_and_tried_again(self) -> None:
        self.redis = await real_redis(self, "--requirepass", "right")
        url = self.redis.url.replace("redis://", "redis://:wrong@")
        one = await self.limited(url, tenant_requests_per_minute=1)
        refused = await self.windows(one).link.refused()
        self.assertRegex(refused, r"^AUTH failed: WRONGPASS invalid username-password pair")
        self.assertEqual(await self.status(one), 200)
        self.assertEqual(self.alone(one), {"not_connected": 1})
        admin = await RedisClient.connect(self.redis.port, b"AUTH right")
        # The operator gives Redis the password the proxy has.
        self.assertEqual(await admin.command(b"CONFIG SET requirepass wrong"), b"+OK\r\n")
        connected = self.windows(one).connected()
        self.clock.advance(RETRY)
        await connected
        self.assertEqual(await self.status(one), 200)  # (Redis's window: empty)
        self.assertEqual(await self.status(one), 429)
        self.assertEqual(self.fallback(one), 0)
        await admin.quit()

    async def test_a_handshake_answered_with_garbage_is_tried_again(self) -> None:
        events = self.logged()
        fake, one = await self.scripted(tenant_requests_per_minute=5)
        fake.answers["SELECT"] = b"HTTP/1.1 400 Bad Request\r\n\r\n"  # (a web server's port)
        refused = await self.windows(one).link.refused()  # (after SILENCE s unanswered)
        self.assertEqual(refused, "SELECT 0 got no answer within 1 s")
        self.assertEqual(await self.status(one), 200)
        self.assertEqual(self.alone(one), {"not_connected": 1})
        self.assertNotIn("EVAL", fake.names())
        fake.answers.update(SELECT=OK, EVAL=b"*1\r\n:0\r\n", EVALSHA=b"*1\r\n:0\r\n")
        connected = self.windows(one).connected()
        self.clock.advance(RETRY)
        await connected
        self.assertEqual(await self.status(one), 200)
        self.assertEqual(fake.names().count("EVAL"), 1)  # (the admission, asked of Redis)
        self.assertEqual((self.fallback(one), self.alone(one)), (0, {"not_connected": 1}))
        self.assertEqual(len(self.warned(events)), 1)

    async def test_a_reply_of_the_wrong_shape_is_redis_away_counted_and_said_once(self) -> None:
        events = self.logged()
        fake, one = await self.scripted(tenant_requests_per_minute=2)
        shapes = [b":5\r\n", b"+OK\r\n", b"*0\r\n", b"$-1\r\n", b"*2\r\n:1\r\n$3\r\nabc\r\n"]
        shapes += [b"*1\r\n:7\r\n", b"$x\r\n"]  # (a code no script returns; not RESP at all)
        if not self.windows(one).link.open:
            await self.windows(one).connected()
        statuses = []
        for shape in shapes:
            fake.answers.update(EVAL=shape, EVALSHA=shape)
            statuses.append(await self.status(one))
        # Each served under this process's own limit (2 a minute), none a 500.
        self.assertEqual(statuses, [200, 200] + [429] * (len(shapes) - 2))
        self.assertEqual(self.alone(one), {"wrong_reply": len(shapes)})
        self.assertEqual(self.fallback(one), 1)
        self.assertEqual(self.warned(events), ["answered with a reply of the wrong shape (5)"])
        self.assertEqual([e for e in events if e.get("log_failure")], [])
        fake.answers.update(EVAL=b"*1\r\n:0\r\n", EVALSHA=b"*1\r\n:0\r\n")
        self.assertEqual(await self.status(one), 200)  # (Redis admits: shared again)
        self.assertEqual(self.fallback(one), 0)

    async def test_each_way_redis_cannot_say_is_counted_by_why_in_words(self) -> None:
        events = self.logged()
        fake, one = await self.scripted(tenant_requests_per_minute=10)
        if not self.windows(one).link.open:
            await self.windows(one).connected()
        admitted = b"*1\r\n:0\r\n"
        oom = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"
        for answer in (oom, admitted, b""):  # (b"": never answered)
            fake.answers.update(EVAL=answer, EVALSHA=answer)
            self.assertEqual(await self.status(one), 200)
        self.assertEqual(self.alone(one), {"error": 1, "timeout": 1})
        self.assertEqual(
            self.warned(events),
            [
                "answered with an error (OOM command not allowed when used memory > 'maxmemory'.)",
                "did not answer within 100 ms",
            ],
        )

    # What a writer to Redis forged of a tenant's window leaves it within two windows: at
    # once, for an entry dated past the window's end or a total no script wrote.
    async def forge(self, *commands: tuple[object, ...]) -> None:
        link = RedisLink(self.redis.url, reactor, lambda why: None)
        link.start()
        self.addCleanup(link.stop)
        tag = hashlib.sha256(b"team-a").hexdigest()[:16]
        for name, key, *rest in commands:
            await link.command(name, f"nixlproxy:{{{tag}}}:{key}", *rest)

    async def test_a_request_dated_far_ahead_leaves_the_window(self) -> None:
        one, _ = await self.shared(tenant_requests_per_minute=1)
        await self.forge(("ZADD", "requests", 10**15, "forged"))
        self.assertEqual(await self.status(one), 200)
        self.assertEqual(self.fallback(one), 0)

    async def test_a_total_no_script_wrote_is_summed_again(self) -> None:
        one, _ = await self.shared(tenant_tokens_per_minute=1000)
        await self.forge(("SET", "total", 10**9), ("SET", "used", "x"))
        self.assertEqual(await self.status(one), 200)  # (and the key of the wrong type, gone)
        self.assertEqual(self.fallback(one), 0)


class RedisClient(Protocol):
    """A connection of a test's own to a real Redis, speaking its inline commands."""

    def __init__(self) -> None:
        self.received = b""
        self._waiting: Deferred[bytes] | None = None
        self.ended: Deferred[None] = Deferred()

    @classmethod
    async def connect(cls, port: int, first: bytes = b"PING") -> RedisClient:
        """Connected, and counted among Redis's clients (its first command answered)."""
        client = await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), cls())
        answer = await client.command(first)
        assert answer in (b"+PONG\r\n", b"+OK\r\n"), answer
        return client

    def command(self, line: bytes) -> Deferred[bytes]:
        """Send one inline command; fires with its one-line answer."""
        self._waiting = Deferred()
        self.transport.write(line + b"\r\n")  # type: ignore[union-attr]
        return self._waiting

    async def quit(self) -> None:
        """QUIT, and wait for Redis to close the connection: it has let the client go."""
        self.transport.write(b"QUIT\r\n")  # type: ignore[union-attr]
        await self.ended

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        line, found, self.received = self.received.partition(b"\r\n")
        if not found:
            self.received = line
        elif self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            waiting.callback(line + found)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.ended.callback(None)
