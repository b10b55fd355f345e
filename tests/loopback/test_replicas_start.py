"""``--replicas-redis`` misconfigured at start, against a real redis-server: a password Redis
asks for and the URL lacks (NOAUTH), a wrong one (WRONGPASS), an unknown host, each one
line that names the fix; a refused connection names its cause; and until Redis has
answered once the replica is not ready and takes no capped slot (never the whole cap alone),
then it is ready and serves what waited."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import LogLevel, formatEvent
from twisted.web.client import ResponseNeverReceived

from nixl_twisted.testing import RunningProxy
from tests.loopback.test_replicas import FleetCase, replicas_of, slots_of
from tests.support import real_redis

PASSWORD = "in the URL (redis://:PASSWORD@HOST:PORT) or in $NIXLPROXY_REPLICAS_REDIS"


class StartTests(FleetCase):
    def said(self, logged: list[dict[str, Any]]) -> list[tuple[LogLevel, str]]:
        """What the replicas said, at which level, each line as written."""
        return [
            (e["log_level"], formatEvent(e))
            for e in logged
            if e.get("log_namespace") == "nixl_twisted.fleet.first_contact"
        ]

    async def one(self, url: str) -> RunningProxy:
        """The fakes and one replica sharing ``url``, each decode instance capped at one."""
        await self.start(proxy={"replicas_redis": url, "decode_max_in_flight": 1})
        return self.proxy

    async def not_ready_and_waits(self, proxy: RunningProxy) -> Deferred[Any]:
        """/health and /healthcheck 503 (saying it waits for Redis), and a completion waits
        for a slot though no leg is in flight: the one it returns."""
        health = await self.http.get(proxy.url + "/health")
        assert health.code == 503
        await health.content()
        check = await self.http.get(proxy.url + "/healthcheck")
        report = json.loads(await check.content())
        assert (check.code, report["ready"], report["waiting_for"]) == (503, False, "redis")
        assert report["replicas"]["reached"] is False and report["replicas"]["problem"]
        page = await self.http.get(proxy.url + "/")
        assert b"NOT READY: Redis not reached since the start" in await page.content()
        entered = slots_of(proxy).entered()
        waiting = self.chat(proxy)
        await entered  # no slot of the cap: not served alone with the whole cap
        assert self.decode.requests_for("decode") == []
        return waiting

    async def leave(self, waiting: Deferred[Any]) -> None:
        """The client of a request that waits leaves."""
        waiting.cancel()
        with self.assertRaises(ResponseNeverReceived):
            await waiting

    async def test_a_password_redis_asks_for_and_the_url_lacks_is_one_line_naming_the_fix(
        self,
    ) -> None:
        redis = await real_redis(self, "--requirepass", "sesame")
        logged = self.logged()
        proxy = await self.one(redis.url)
        await replicas_of(proxy).beat()
        waiting = await self.not_ready_and_waits(proxy)
        ((level, line),) = self.said(logged)
        assert level == LogLevel.error
        assert "NOAUTH" in line and f"Redis asks for a password: give it {PASSWORD}" in line
        assert "sesame" not in line
        await self.leave(waiting)

    async def test_a_wrong_password_is_one_line_naming_the_fix(self) -> None:
        redis = await real_redis(self, "--requirepass", "sesame")
        logged = self.logged()
        url = redis.url.replace("redis://", "redis://:wrong@")
        proxy = await self.one(url)
        await replicas_of(proxy).link.refused()
        await replicas_of(proxy).beat()
        await self.leave(await self.not_ready_and_waits(proxy))
        said = self.said(logged)
        ((level, line),) = said
        assert level == LogLevel.error
        assert "WRONGPASS" in line and "Redis refused the password: give the right one" in line
        assert "wrong@" not in line  # (the URL shown without its password)
        assert replicas_of(proxy).status()["reached"] is False

    async def test_an_unknown_host_is_one_line_naming_the_fix(self) -> None:
        logged = self.logged()
        proxy = await self.one("redis://redis.nixl-no-such-host.invalid:6379")
        await replicas_of(proxy).beat()
        await self.leave(await self.not_ready_and_waits(proxy))
        ((level, line),) = self.said(logged)
        assert level == LogLevel.error
        assert "the host name redis.nixl-no-such-host.invalid is not known" in line
        assert "check the host name in the URL" in line

    async def test_a_refused_connection_names_its_cause_and_the_replica_is_ready_once_reached(
        self,
    ) -> None:
        redis = await real_redis(self)
        await redis.stop()  # (its port known: not listening yet)
        logged = self.logged()
        proxy = await self.one(redis.url)
        replicas = replicas_of(proxy)
        await replicas.beat()
        waiting = await self.not_ready_and_waits(proxy)
        ((level, line),) = self.said(logged)
        assert level == LogLevel.warn
        assert "could not be reached: the connection to 127.0.0.1:" in line and "refused" in line
        assert "not ready, and takes no capped slot, until it reaches Redis" in line
        await redis.start()
        await replicas.link.connected()
        await replicas.beat()
        assert replicas.status()["reached"] and replicas.status()["problem"] is None
        response = await waiting  # what waited goes, through the fleet's queue
        assert response.code == 200
        await response.content()
        health = await self.http.get(proxy.url + "/health")
        assert health.code == 200
        await health.content()
