"""Decode's handles shared by replicas through one real Redis: kept by one, found by the
other, read by one of them only; what a writer to Redis forged under a handle's key is
never read as one."""

from __future__ import annotations

import json

from twisted.internet import reactor

from nixl_twisted.fleet.link import RedisLink
from nixl_twisted.fleet.replies import prefix_of
from nixl_twisted.reuse import HandleStore, scope_of
from nixl_twisted.reuse.handles import prefix_keys
from nixl_twisted.testing import RunningProxy
from tests.loopback.test_replicas import FleetCase
from tests.pure.test_reuse_handles import PARAMS, TURN, sharing_an_opening

SCOPE = scope_of("acme", None, "fake-model")


def handles_of(proxy: RunningProxy) -> HandleStore:
    return proxy.app.serving.legs.handles


class SharedHandleTests(FleetCase):
    async def test_a_handle_one_replica_kept_is_found_by_the_other_and_read_once(self) -> None:
        other = await self.two()
        here, there = handles_of(self.proxy), handles_of(other)
        assert await here.keep(SCOPE, here.made(PARAMS, self.decode.url, TURN)) == "kept"
        assert len(here) == 0  # (kept in Redis, not here: any replica may read it)
        prompt = [*TURN, 1, 2, 3]
        found_here = await here.find(SCOPE, prompt)
        found_there = await there.find(SCOPE, prompt)
        assert (found_here.why, found_there.why) == ("found", "found")
        assert found_there.handle == found_here.handle
        claims = [await there.claim(found_there), await here.claim(found_here)]
        assert claims == ["used", "taken"]
        assert (await here.find(SCOPE, prompt)).why == "none"

    async def test_a_turn_one_replica_kept_tells_the_other_its_answer_did_not_extend(
        self,
    ) -> None:
        other = await self.two()
        here, there = handles_of(self.proxy), handles_of(other)
        await here.keep(SCOPE, here.made(PARAMS, self.decode.url, TURN, asked=150))
        rendered = [*TURN[:150], *range(5, 60), 9]
        assert (await there.find(SCOPE, rendered)).why == "mismatch"
        assert (await there.find(SCOPE, [*TURN[:100], *range(5, 120)])).why == "none"

    async def test_conversations_the_same_to_a_keys_length_each_read_their_own(self) -> None:
        other = await self.two()
        here, there = handles_of(self.proxy), handles_of(other)
        first, second = sharing_an_opening()
        short = dict(PARAMS, remote_num_tokens=139)
        for turn in (first, second):
            assert await here.keep(SCOPE, here.made(short, self.decode.url, turn)) == "kept"
        found = [await there.find(SCOPE, [*turn, 7]) for turn in (first, second)]
        assert [tuple(f.handle.tokens) for f in found if f.handle] == [first, second]
        assert [await there.claim(f) for f in found] == ["used", "used"]
        assert [(await here.find(SCOPE, [*t, 7])).why for t in (first, second)] == [
            "none",
            "none",
        ]

    async def test_redis_keeps_a_handle_for_decodes_lifetime_and_no_longer(self) -> None:
        await self.two()
        here = handles_of(self.proxy)
        here.lifetime = 0.2
        await here.keep(SCOPE, here.made(PARAMS, self.decode.url, TURN))
        key = here.made(PARAMS, self.decode.url, TURN).key(SCOPE)
        assert key is not None
        link = self.link_to_redis()
        ttl = await link.command("PTTL", prefix_of(self.redis.url) + "handle:" + key.hex())
        assert 0 < ttl <= 200 - 200 // 3  # (its lifetime less the margin: a third of it)

    async def test_what_a_writer_forged_under_a_handles_key_is_not_read(self) -> None:
        await self.two()
        here = handles_of(self.proxy)
        prompt = [*TURN, 1]
        link = self.link_to_redis()
        for forged in (b"garbage", b'{"params": {}, "instance": "x"}', b"\xff\xfe"):
            for key in prefix_keys(SCOPE, prompt):
                name = prefix_of(self.redis.url) + "handle:" + key.hex()
                await link.command("SET", name, forged)
            found = await here.find(SCOPE, prompt)
            assert (found.why, found.handle) == ("none", None)

    def link_to_redis(self) -> RedisLink:
        link = RedisLink(self.redis.url, reactor, lambda why: None)
        link.start()
        self.addCleanup(link.stop)
        return link


SYSTEM = {"role": "system", "content": "You answer questions on the NIXL transfer. " * 12}
FIRST = [SYSTEM, {"role": "user", "content": "How does decode pull the KV?"}]


class FleetReuseTests(FleetCase):
    async def test_a_turn_reads_back_what_another_replica_kept_and_a_retry_does_not(
        self,
    ) -> None:
        other = await self.two(multi_turn_reuse=True)
        for fake in self.prefills + self.decodes:
            fake.bidirectional = True
        events = self.access_events()
        first = await self.chat(self.proxy, {"model": "fake-model", "messages": FIRST})
        said = json.loads(await first.content())
        content = said["choices"][0]["message"]["content"]
        second = [
            *FIRST,
            {"role": "assistant", "content": content},
            {"role": "user", "content": "And after that?"},
        ]
        answers = []
        for proxy in (other, self.proxy):  # (the next turn on the other replica, then again)
            response = await self.chat(proxy, {"model": "fake-model", "messages": second})
            assert response.code == 200
            answers.append(json.loads(await response.content()))
        (read,) = self.prefill.handles_read
        assert read["extends"] and not read["again"]
        assert events[-2]["reuse"] == "used"
        assert events[-1]["reuse"] in ("none", "mismatch")
        assert answers[0]["choices"] == answers[1]["choices"]
