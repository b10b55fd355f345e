"""Replicas on a real Redis, each leg holding its slot only while its engine works: a decode
lease is taken once prefill answered, a prefilled request waits in its model's ready lane in
Redis (kept by the heartbeat, never timed out), and moves alone and back with Redis."""

from __future__ import annotations

from twisted.internet.defer import Deferred

from nixl_twisted.admission.waiting import READY_SUFFIX
from tests.loopback.test_replicas import replicas_of, shared_of, slots_of
from tests.loopback.test_replicas_heal import HealCase
from tests.support import CHAT


class ReadyLaneTests(HealCase):
    async def test_a_decode_slot_is_leased_in_redis_only_once_prefill_answered(self) -> None:
        self.other = await self.forging(prefill_max_in_flight=1)
        self.prefill.hold_answers()
        held = self.prefill.stream_held()
        answer = self.chat(self.other)
        await held  # in prefill: its prefill slot is leased in Redis, no decode slot
        assert shared_of(self.other).view == {f"prefill|{self.prefill.url}": 1}
        leases = await self.write("SMEMBERS", f"r:{replicas_of(self.other).id}:leases")
        assert [lease.rsplit("|", 1)[0] for lease in leases] == [f"prefill|{self.prefill.url}"]
        self.prefill.release()
        response = await answer
        assert response.code == 200
        await response.content()
        await replicas_of(self.other).beat()
        assert shared_of(self.other).view == {}

    async def test_a_ready_request_waits_in_its_ready_lane_kept_by_heartbeats_untimed(
        self,
    ) -> None:
        self.other = await self.forging(queue_timeout=1)
        held = await self.held_stream()  # the fleet's one decode slot
        waits = slots_of(self.other).entered()
        ready = self.chat(self.other)
        await waits  # prefilled, it waits for the decode slot
        mine = replicas_of(self.other)
        (entry,) = await self.write("SMEMBERS", f"r:{mine.id}:waits")
        model, priority, member = entry.split("\n")
        assert (model, priority) == (READY_SUFFIX, "0")  # (the ready lane of "": no model named)
        assert await self.write("ZCARD", f"q:{READY_SUFFIX}:0") == 1
        for replica in (self.proxy, self.other):
            await replicas_of(replica).beat()  # (held by a live replica: kept, counted)
        assert await self.write("ZRANGE", f"q:{READY_SUFFIX}:0", 0, -1) == [member]
        assert int(await self.write("GET", "waiting")) == 1
        self.clock.advance(2)  # (past the queue's timeout: a ready request waits on)
        assert [w.ticket.is_ready for w in slots_of(self.other).queue.waiting()] == [True]
        self.decode.release()
        await held.done
        response = await ready
        assert response.code == 200
        await response.content()
        assert await self.write("ZCARD", f"q:{READY_SUFFIX}:0") == 0
        assert await self.write("SMEMBERS", f"r:{mine.id}:waits") == []

    async def test_a_forged_ready_lane_entry_no_replica_holds_is_dropped(self) -> None:
        self.other = await self.forging()
        live = replicas_of(self.proxy).id
        forged = f"0000000000000000:{live}:x"
        await self.write("ZADD", f"q:{READY_SUFFIX}:0", 0, forged)
        await self.write("ZADD", f"qp:{READY_SUFFIX}", 0, "0")
        assert await self.answered(self.other) == 200  # (not queued behind it: it is dropped)
        assert await self.write("ZCARD", f"q:{READY_SUFFIX}:0") == 0

    async def test_a_ready_request_moves_alone_and_back_with_redis(self) -> None:
        other = await self.two(decode_max_in_flight=2)
        slot = f"decode|{self.decode.url}"
        mine = replicas_of(other)
        await mine.beat()  # (it has seen both replicas alive: alone, its share is 1)
        await replicas_of(self.proxy).stopService()  # (only ``other`` writes back)
        self.decode.hold_streams_after(1)
        self.addCleanup(self.decode.release)
        streams: list[Deferred[object]] = []
        for _ in range(2):  # the fleet's two decode slots, both through ``other``
            held = self.decode.stream_held()
            streams.append(self.chat(other, dict(CHAT, stream=True)))
            await held
        waits = slots_of(other).entered()
        streams.append(self.chat(other, dict(CHAT, stream=True)))
        await waits  # prefilled, waiting in the fleet's ready lane
        await self.redis.stop()
        await mine.beat()  # alone: it waits in this replica's own ready lane
        assert not mine.is_shared
        queue = slots_of(other).queue
        assert [w.ticket.is_ready for w in queue.waiting()] == [True]
        assert len(queue.alone_queue.local) == 1  # type: ignore[union-attr]
        await self.redis.start()  # (an empty memory)
        await mine.link.connected()
        waits = slots_of(other).entered()
        await mine.beat()  # its leases written back; the ready one asks the fleet again
        await waits
        assert [w.ticket.is_ready for w in queue.waiting()] == [True]
        assert len(queue.alone_queue.local) == 0  # type: ignore[union-attr]
        assert await mine.link.command("ZCARD", f"{mine.prefix}q:{READY_SUFFIX}:0") == 1
        assert shared_of(other).view == {slot: 2}  # (none placed past Redis)
        held = self.decode.stream_held()
        self.decode.release()  # the first two end: the ready one takes a slot
        self.decode.hold_streams_after(1)
        await held
        self.decode.release()
        for stream in streams:
            response = await stream
            await response.content()  # type: ignore[attr-defined]
        assert len(self.decode.requests_for("decode")) == 3
        await mine.beat()
        assert shared_of(other).view == {}
