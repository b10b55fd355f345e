"""``--replicas-redis``, the fleet's full queue: the request its fair order lets go last is
pushed out for a newcomer it lets go sooner, whichever replica holds either, and its own
replica answers it 503 ``queue_full``, told by a message or, that lost, by Redis when it
asks."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred

from nixl_twisted.testing import RunningProxy
from tests.loopback.test_replicas import FleetCase, replicas_of, slots_of
from tests.support import CHAT

TENANTS = json.dumps({"a": {"weight": 3}, "b": {"weight": 1}})


class FleetRoomTests(FleetCase):
    async def full(self) -> tuple[RunningProxy, list[Deferred[Any]]]:
        """Two replicas, the fleet's one decode slot held through this one, and the queue
        (two: Redis counts the ready lane too) full of tenant b's requests on the other, its
        first prefilled and ready (tag 2), its second waiting for prefill (tag 3)."""
        other = await self.two(tenant_header="x-team", tenants=TENANTS, queue_size=2)
        held = await self.held_stream()
        self.addCleanup(lambda: held.done)
        self.addCleanup(self.decode.release)
        waiting = []
        for n in range(2):
            waits = slots_of(other).entered()
            waiting.append(self.chat(other, dict(CHAT, user=f"b-{n}"), {"x-team": "b"}))
            await waits
        return other, waiting

    def pushed_out(self, proxy: RunningProxy) -> float:
        value: float = proxy.app.metrics.admissions.labels("pushed_out")._value.get()
        return value

    async def test_a_newcomer_on_one_replica_pushes_out_the_fleets_last_on_the_other(
        self,
    ) -> None:
        other, (first_b, last_b) = await self.full()
        events = self.access_events()
        waits = slots_of(self.proxy).entered()
        newcomer = self.chat(self.proxy, dict(CHAT, user="a-0"), {"x-team": "a"})
        await waits  # a's (tag 1/3) waits in the room b's last (tag 2) left
        refused = await last_b
        assert refused.code == 503 and refused.headers.getRawHeaders("Retry-After")
        assert b"queue_full" in await refused.content()
        assert [e.get("ended") for e in events] == ["pushed_out"]
        assert (self.pushed_out(other), self.pushed_out(self.proxy)) == (1, 0)
        assert slots_of(other).queue._waiting == 2  # (the fleet's count, as it said last)
        link, prefix = replicas_of(other).link, replicas_of(other).prefix
        # (The model's waiting lane: its ready lane, a tab in its name, has its own tags.)
        (tags,) = [k for k in await link.command("KEYS", prefix + "last:*") if "\t" not in k]
        # The held request and b's first (prefilled at once, one ahead of decode, ready)
        # took the clock to 2; b's last tag is given back (3, the one pushed out, to 2):
        # b's next is tagged as if that one never came.
        assert [float(await link.command("HGET", tags, t)) for t in "ab"] == [2 + 1 / 3, 2.0]
        self.decode.release()
        for answered in (await newcomer, await first_b):
            assert answered.code == 200
            await answered.content()
        users = [(r.body or {}).get("user") for r in self.decode.requests_for("decode")]
        assert users[1:] == ["a-0", "b-0"]  # and the last never reached an instance

    async def test_a_replica_that_missed_the_message_answers_at_its_next_heartbeat(
        self,
    ) -> None:
        other, (_, last_b) = await self.full()
        replicas_of(other)._pushed.clear()  # (the message that says so is lost)
        waits = slots_of(self.proxy).entered()
        newcomer = self.chat(self.proxy, dict(CHAT, user="a-0"), {"x-team": "a"})
        await waits
        assert len(slots_of(other).queue) == 2  # no message reached its replica
        await replicas_of(other).beat()  # its place is gone from Redis's records: it asks
        refused = await last_b
        assert refused.code == 503 and b"queue_full" in await refused.content()
        assert self.pushed_out(other) == 1
        self.decode.release()
        answered = await newcomer
        assert answered.code == 200
        await answered.content()

    async def test_a_newcomer_the_fleet_would_let_go_last_is_refused_as_before(self) -> None:
        other, _ = await self.full()
        refused = await self.chat(self.proxy, dict(CHAT, user="b-2"), {"x-team": "b"})
        assert refused.code == 503 and b"queue_full" in await refused.content()
        assert len(slots_of(other).queue) == 2 and self.pushed_out(other) == 0
