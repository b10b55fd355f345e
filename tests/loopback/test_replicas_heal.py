"""``--replicas-redis`` heals what a writer to Redis forged: two proxies before one real
redis-server, and a connection of the test's own that writes what a security probe wrote
(a count, a queue entry, a replica, a lease entry, a replica's info, tenants' tags). Each is
gone within a heartbeat, driven here by hand (``Replicas.beat``), or never reaches a
request; no heartbeat fails on any of it."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred

from nixl_twisted.fleet.heartbeat import INFO_MAX
from nixl_twisted.fleet.link import RedisLink
from nixl_twisted.fleet.replies import prefix_of, text
from nixl_twisted.testing import RunningProxy
from tests.loopback.test_replicas import FleetCase, replicas_of, shared_of, slots_of
from tests.support import CHAT


class HealCase(FleetCase):
    """Two proxies sharing one real Redis, and the test's own connection to it."""

    other: RunningProxy

    async def forging(self, decodes: int = 1, **settings: Any) -> RunningProxy:
        other = await self.two(decodes, **settings)
        self.link = RedisLink(self.redis.url, reactor, lambda why: None)
        self.link.start()
        self.addCleanup(self.link.stop)
        self.prefix = prefix_of(self.redis.url)
        return other

    async def write(self, *args: object) -> Any:
        """One command of the test's, its key (the second word) under the fleet's prefix."""
        command, key, *rest = args
        return await self.link.command(command, self.prefix + str(key), *rest)

    async def now_ms(self) -> int:
        seconds, micros = await self.link.command("TIME")
        return int(seconds) * 1000 + int(micros) // 1000

    async def answered(self, proxy: RunningProxy, headers: dict[str, str] | None = None) -> int:
        response = await self.chat(proxy, headers=headers)
        await response.content()
        return int(response.code)

    def shared(self) -> list[bool]:
        return [replicas_of(p).is_shared for p in (self.proxy, self.other)]


class HealTests(HealCase):
    async def test_a_forged_slots_count_is_rebuilt_by_the_next_heartbeat(self) -> None:
        self.other = await self.forging()
        await self.write("HSET", "slots", f"decode|{self.decode.url}", 5)  # (its cap is 1)
        waits = slots_of(self.other).entered()
        waiting = self.chat(self.other)
        await waits  # the fleet's one slot looks taken
        await replicas_of(self.proxy).beat()  # one heartbeat, of either replica
        response = await waiting
        assert response.code == 200
        await response.content()
        assert await self.write("HGETALL", "slots") == []
        assert self.shared() == [True, True]

    async def test_a_forged_queue_entry_naming_a_live_replica_holds_up_nobody(self) -> None:
        self.other = await self.forging()
        live = replicas_of(self.proxy).id
        forged = f"0000000000000000:{live}:x"  # (its replica is alive, but it holds no such)
        await self.write("ZADD", "q::0", 0, forged)
        await self.write("ZADD", "qp:", 0, "0")
        assert await self.answered(self.other) == 200  # (not queued behind it: it is dropped)
        assert await self.write("ZCARD", "q::0") == 0

    async def test_a_forged_queue_entry_in_a_live_replicas_own_record_is_given_back(
        self,
    ) -> None:
        self.other = await self.forging()
        for proxy in (self.proxy, self.other):  # (the model is named: its queue is its own)
            for instance in proxy.app.view.backends.decode.instances:
                instance.models = {"fake-model": {"id": "fake-model"}}
        live = replicas_of(self.proxy).id
        forged = f"0000000000000000:{live}:x"  # (first of the model's queue, and recorded as
        await self.write("ZADD", "q:fake-model:0", 0, forged)  # its live replica's own)
        await self.write("ZADD", "qp:fake-model", 0, "0")
        await self.write("SADD", f"r:{live}:waits", f"fake-model\n0\n{forged}")
        waits = slots_of(self.other).entered()
        waiting = self.chat(self.other)
        await waits  # queued behind it
        await replicas_of(self.other).beat()  # (another replica cannot tell it is forged)
        assert len(slots_of(self.other).queue) == 1
        await replicas_of(self.proxy).beat()  # its replica holds no such: it gives it back
        response = await waiting
        assert response.code == 200
        await response.content()
        assert await self.write("ZCARD", "q:fake-model:0") == 0
        assert await self.write("SMEMBERS", f"r:{live}:waits") == []
        assert await self.answered(self.proxy) == 200

    async def test_a_forged_lease_in_a_live_replicas_own_record_is_given_back(self) -> None:
        self.other = await self.forging()
        live = replicas_of(self.proxy).id
        await self.write("SADD", f"r:{live}:leases", f"decode|{self.decode.url}|forged")
        await replicas_of(self.other).beat()  # counted: the one slot (cap 1) looks taken
        assert shared_of(self.other).view == {f"decode|{self.decode.url}": 1}
        waits = slots_of(self.other).entered()
        waiting = self.chat(self.other)
        await waits
        await replicas_of(self.proxy).beat()  # its replica holds no such lease: given back
        response = await waiting
        assert response.code == 200
        await response.content()
        assert await self.write("SMEMBERS", f"r:{live}:leases") == []

    async def test_a_forged_tenants_place_in_a_live_replicas_own_record_is_given_back(
        self,
    ) -> None:
        self.other = await self.forging(tenant_header="x-team", tenant_max_in_flight=1)
        live = replicas_of(self.proxy).id
        await self.write("SADD", f"r:{live}:tenants", "a|forged")
        await replicas_of(self.other).beat()  # counted: tenant a looks at its limit
        assert await self.answered(self.other, {"x-team": "a"}) == 429
        await replicas_of(self.proxy).beat()  # its replica holds no such place: given back
        assert await self.write("SMEMBERS", f"r:{live}:tenants") == []
        await replicas_of(self.other).beat()
        assert await self.answered(self.other, {"x-team": "a"}) == 200

    async def test_a_forged_tenants_count_refuses_until_the_next_heartbeat(self) -> None:
        self.other = await self.forging(tenant_header="x-team", tenant_max_in_flight=1)
        await self.write("HSET", "tenants", "a", 100)
        assert await self.answered(self.other, {"x-team": "a"}) == 429
        await replicas_of(self.other).beat()
        assert await self.write("HGETALL", "tenants") == []
        assert await self.answered(self.other, {"x-team": "a"}) == 200

    async def test_a_forged_message_is_undone_by_the_next_heartbeat(self) -> None:
        self.other = await self.forging()
        theirs = shared_of(self.other)
        heard = Deferred[None]()

        def told(changed: dict[str, int], version: int | None) -> None:
            if not heard.called:
                heard.callback(None)

        replicas_of(self.other).on_freed(told)
        await self.link.command("PUBLISH", self.prefix + "freed", f"#{2**52}\nforged|x\t9")
        await heard
        assert theirs.view == {"forged|x": 9}
        await replicas_of(self.other).beat()
        assert theirs.view == {}  # (and messages of Redis's own versions apply again)

    async def test_a_forged_grant_time_is_dropped(self) -> None:
        self.other = await self.forging()
        await self.write("LPUSH", "grants", "soon")
        await replicas_of(self.other).beat()
        assert await self.answered(self.other) == 200
        assert self.shared() == [True, True]
        assert "soon" not in [text(g) for g in await self.write("LRANGE", "grants", 0, -1)]

    async def test_a_forged_waiting_count_is_rebuilt(self) -> None:
        self.other = await self.forging()
        await self.write("SET", "waiting", "1000000")
        await replicas_of(self.other).beat()
        assert text(await self.write("GET", "waiting")) == "0"

    async def test_a_count_that_is_no_number_is_redis_not_answering_then_healed(self) -> None:
        self.other = await self.forging(decodes=2)
        second = f"decode|{self.decodes[1].url}"
        await self.write("HSET", "slots", second, "many")
        events = self.logged()
        # The placement's answer shows the forged count: read as Redis not answering, the
        # request is served alone (its local slots given back), never left hanging.
        assert await self.answered(self.other) == 200
        assert not replicas_of(self.other).is_shared
        assert [e for e in events if e.get("log_failure")] == []
        decode = [i for i in self.other.app.view.backends.decode.instances if i.in_flight]
        assert decode == []
        await replicas_of(self.other).beat()  # rebuilt, and this replica shares again
        assert await self.write("HGETALL", "slots") == []
        assert self.shared() == [True, True]


class ForgedReplicaTests(HealCase):
    async def test_a_dead_replica_with_a_malformed_lease_is_forgotten_without_error(
        self,
    ) -> None:
        self.other = await self.forging()
        await self.write("ZADD", "alive", 1, "fake")  # (lapsed long ago)
        await self.write("SADD", "r:fake:leases", "no-bar", "decode|http://x:1|1")
        await self.write("SADD", "r:fake:tenants", "no-bar")
        await self.write("SADD", "r:fake:waits", "no-newline")
        await replicas_of(self.other).beat()
        assert self.shared() == [True, True]  # the heartbeat did not fail
        assert await self.write("ZSCORE", "alive", "fake") is None
        assert await self.write("EXISTS", "r:fake:leases") == 0

    async def test_a_live_replica_with_a_malformed_lease_fails_no_heartbeat(self) -> None:
        self.other = await self.forging()
        await self.write("ZADD", "alive", await self.now_ms() + 2000, "fake")
        await self.write("SADD", "r:fake:leases", "no-bar")
        await self.write("HSET", "slots", "no-bar", 1)
        await replicas_of(self.other).beat()
        assert self.shared() == [True, True]
        assert await self.write("SMEMBERS", "r:fake:leases") == []
        assert await self.write("HGETALL", "slots") == []

    async def test_a_far_future_liveness_is_brought_back_to_now_plus_the_ttl(self) -> None:
        self.other = await self.forging()
        for n in range(5):
            await self.write("ZADD", "alive", 10**15, f"forged-{n}")
        mine = replicas_of(self.other)
        await mine.beat()
        latest = await self.now_ms() + int(mine.ttl * 1000)
        for n in range(5):  # each lapses within the TTL, and is forgotten at the next beat
            assert float(await self.write("ZSCORE", "alive", f"forged-{n}")) <= latest

    async def test_a_huge_info_is_not_read(self) -> None:
        self.other = await self.forging()
        await self.write("ZADD", "alive", await self.now_ms() + 2000, "fake")
        huge = json.dumps({"host": "x" * (1 << 20)})
        await self.write("HSET", "info", "fake", huge)
        mine = replicas_of(self.other)
        await mine.beat()
        assert mine.seen["fake"] == {}  # (seen alive, its info left unread)
        small = json.dumps({"host": "h" * (INFO_MAX // 2)})
        await self.write("HSET", "info", "fake", small)
        await mine.beat()
        assert mine.seen["fake"]["host"] == "h" * (INFO_MAX // 2)

    async def test_a_key_of_the_wrong_type_is_replaced(self) -> None:
        self.other = await self.forging()
        await self.write("SET", "slots", "x")
        await self.write("SET", "r:fake:leases", "x")
        await self.write("ZADD", "alive", 1, "fake")
        await replicas_of(self.other).beat()
        assert self.shared() == [True, True]
        assert await self.answered(self.other) == 200


class TagsTests(HealCase):
    async def test_a_tenants_last_tag_that_the_clock_passed_is_forgotten(self) -> None:
        self.other = await self.forging(tenant_header="x-team")
        for n in range(3):
            assert await self.answered(self.other, {"x-team": f"t-{n}"}) == 200
        assert await self.write("HLEN", "last:") == 3
        await self.write("HSET", "last:", "forged", "not a number")
        await replicas_of(self.other).beat()
        assert await self.write("HLEN", "last:") == 0  # (each tag was the clock's, or past)
        assert await self.answered(self.other, {"x-team": "t-0"}) == 200

    async def test_a_model_no_instance_is_known_to_serve_makes_no_key(self) -> None:
        self.other = await self.forging(decodes=2)
        said, _ = self.other.app.view.backends.decode.instances
        said.models = {"fake-model": {"id": "fake-model"}}  # (the other has not said yet)
        body = dict(CHAT, model="chosen-by-the-client")
        response = await self.chat(self.other, body)
        assert response.code == 200  # (the instance that has not said may serve it)
        await response.content()
        keys = await self.link.command("KEYS", "*chosen-by-the-client*")
        assert keys == []
