"""``--replicas-redis``: two proxies before one real redis-server act as one proxy: an
instance's cap holds for both, a request waits in the fleet's order whichever proxy holds
it, and a proxy that loses Redis goes on alone (its static share of each cap) and shares
again when Redis is back, with no slot lost or counted twice."""

from __future__ import annotations

import json
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.web.client import Agent, HTTPConnectionPool, ResponseNeverReceived

from nixl_twisted.admission.shared_slots import SharedSlots
from nixl_twisted.admission.slots import Slots
from nixl_twisted.fleet.replicas import Replicas
from nixl_twisted.testing import RunningProxy
from tests.support import CHAT, ChunkCollector, ProxyCase, real_redis, sse_events


def replicas_of(proxy: RunningProxy) -> Replicas:
    found = proxy.service.getServiceNamed("replicas")
    assert isinstance(found, Replicas)
    return found


def slots_of(proxy: RunningProxy) -> Slots:
    slots = proxy.app.serving.legs.slots
    assert slots is not None
    return slots


def shared_of(proxy: RunningProxy) -> SharedSlots:
    queue = slots_of(proxy).queue
    shared = getattr(queue, "slots", None)
    assert isinstance(shared, SharedSlots)
    return shared


class FleetCase(ProxyCase):
    """Two proxies sharing one real redis-server."""

    timeout = 20

    async def two(self, decodes: int = 1, **settings: Any) -> RunningProxy:
        """Redis, the fakes and two proxies sharing it, each shared once it has beaten."""
        self.redis = await real_redis(self)
        self.settings = {"replicas_redis": self.redis.url, "decode_max_in_flight": 1, **settings}
        await self.start(decodes=decodes, proxy=self.settings)
        other = self.start_proxy(
            [f.url for f in self.prefills], [f.url for f in self.decodes], **self.settings
        )
        for each in (self.proxy, other):
            await replicas_of(each).ready()
        return other

    def chat(
        self, proxy: RunningProxy, body: object = CHAT, headers: dict[str, str] | None = None
    ) -> Deferred[Any]:
        client = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        sent: dict[bytes | str, bytes | str] = {"Content-Type": "application/json"}
        sent.update(headers or {})
        return client.post(
            proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=sent
        )


class ReplicasTests(FleetCase):
    async def test_an_instances_cap_holds_for_every_replica(self) -> None:
        other = await self.two()
        held = await self.held_stream()  # the one decode slot, held through this proxy
        waits = slots_of(other).entered()
        second = self.chat(other)
        await waits  # the other proxy's request waits: the fleet's only slot is taken
        assert len(self.decode.requests_for("decode")) == 1
        assert shared_of(other).view == {f"decode|{self.decode.url}": 1}
        self.decode.release()
        response = await second
        assert response.code == 200
        await response.content()
        await held.done
        assert len(self.decode.requests_for("decode")) == 2

    async def test_the_slots_of_a_replica_whose_heartbeat_stops_come_back(self) -> None:
        other = await self.two()
        await self.held_stream()
        self.addCleanup(self.decode.release)
        gone = replicas_of(self.proxy)
        gone.ttl = 0.0  # its last heartbeat lapses at once: as a replica killed after it
        await gone.beat()
        await gone.link.stop()  # (killed: no sign-out)
        await gone.stopService()
        waits = slots_of(other).entered()
        second = self.chat(other)
        await waits
        assert shared_of(other).view == {f"decode|{self.decode.url}": 1}
        await replicas_of(other).beat()  # forgets the lapsed replica, and its slot
        self.decode.release()  # (the fake held every answer after its first event)
        response = await second
        assert (response.code, len(self.decode.requests_for("decode"))) == (200, 2)
        await response.content()
        assert replicas_of(other).metrics.leases_expired._value.get() == 1
        assert list(replicas_of(other).seen) == [replicas_of(other).id]

    async def test_a_replica_that_stops_signs_out_giving_back_what_it_holds_at_once(
        self,
    ) -> None:
        other = await self.two()
        await self.held_stream()  # the fleet's one decode slot, held through this proxy
        waits = slots_of(other).entered()
        second = self.chat(other)
        await waits
        logged = self.logged()
        gone = replicas_of(self.proxy)
        beating = gone.beat()  # (a heartbeat on its way as the replica stops)
        await gone.stopService()  # (its stream still held, as one cut at the drain timeout)
        await beating
        mine = replicas_of(other)
        alive = await mine.link.command("ZRANGE", mine.prefix + "alive", 0, -1)
        info = await mine.link.command("HEXISTS", mine.prefix + "info", gone.id)
        leases = await mine.link.command("EXISTS", f"{mine.prefix}r:{gone.id}:leases")
        assert (alive, info, leases) == ([mine.id], 0, 0)  # now, not past its TTL
        self.decode.release()  # (the fake held every answer after its first event)
        response = await second  # the slot it held went to the other's request
        assert (response.code, len(self.decode.requests_for("decode"))) == (200, 2)
        await response.content()
        assert mine.metrics.leases_expired._value.get() == 0  # (no heartbeat had to)
        said = [e for e in logged if str(e.get("log_namespace")).startswith("nixl_twisted.fleet")]
        assert [e["log_level"].name for e in said] == ["info"]
        assert "signed out of Redis" in said[0]["log_format"]

    async def test_redis_away_each_replica_holds_its_share_then_shares_again(self) -> None:
        other = await self.two(decode_max_in_flight=2)
        mine = replicas_of(other)
        await mine.beat()  # (it has seen both replicas alive)
        assert len(mine.seen) == 2
        await self.redis.stop()
        await mine.beat()  # (no answer: alone)
        assert (mine.is_shared, mine.metrics.fallback._value.get()) == (False, 1.0)
        decode = other.app.view.backends.decode.instances[0]
        assert decode.slots == 1  # the cap of 2 over the 2 replicas last seen
        response = await self.chat(other)
        assert response.code == 200
        await response.content()
        await self.redis.start()
        await mine.link.connected()
        await mine.beat()
        assert mine.is_shared and decode.slots == 2

    async def test_what_a_replica_placed_or_queued_alone_is_the_fleets_when_redis_returns(
        self,
    ) -> None:
        other = await self.two(decode_max_in_flight=2)
        slot = f"decode|{self.decode.url}"
        mine = replicas_of(other)
        await mine.beat()  # (it has seen both replicas alive: alone, its share is 1)
        await replicas_of(self.proxy).stopService()  # (only ``other`` writes back)
        await self.redis.stop()
        await mine.beat()
        assert not mine.is_shared
        self.decode.hold_streams_after(1)
        self.addCleanup(self.decode.release)
        held = self.decode.stream_held()
        first = self.chat(other, dict(CHAT, stream=True))  # placed alone: its share
        await held
        waits = slots_of(other).entered()
        held = self.decode.stream_held()
        second = self.chat(other, dict(CHAT, stream=True))  # waits in its own queue
        await waits
        await self.redis.start()  # (an empty memory)
        await mine.link.connected()
        await mine.beat()  # the lease placed alone written back; the one waiting asks Redis
        await held
        assert shared_of(other).view == {slot: 2}  # both counted: none placed past Redis
        self.decode.release()
        for stream in (first, second):
            await (await stream).content()
        await mine.beat()
        assert shared_of(other).view == {}

    async def test_a_redis_that_lost_its_memory_is_told_what_each_replica_holds(self) -> None:
        other = await self.two(decode_max_in_flight=2)
        slot = f"decode|{self.decode.url}"
        self.decode.hold_streams_after(1)
        self.addCleanup(self.decode.release)
        streams = []
        for proxy in (self.proxy, other):  # a decode slot held through each replica
            held = self.decode.stream_held()
            streams.append(self.chat(proxy, dict(CHAT, stream=True)))
            await held
        mine = replicas_of(other)
        await mine.beat()
        assert shared_of(other).view == {slot: 2}
        await replicas_of(self.proxy).stopService()  # (it will not write its lease back)
        await self.redis.stop()
        await self.redis.start()  # (the same port, an empty memory)
        await mine.link.connected()
        await mine.beat()  # Redis forgot it: it writes back the one lease it holds
        assert (mine.is_shared, shared_of(other).view) == (True, {slot: 1})
        self.decode.release()
        for stream in streams:
            await (await stream).content()
        await mine.beat()
        assert shared_of(other).view == {}  # given back when its leg ended, not twice

    async def test_a_request_that_times_out_or_whose_client_leaves_leaves_the_fleets_queue(
        self,
    ) -> None:
        other = await self.two(queue_timeout=5)
        held = await self.held_stream()
        waits = slots_of(other).entered()
        ahead = self.chat(other)  # prefilled, ready for the decode slot: never timed out
        await waits
        waits = slots_of(other).entered()
        timing_out = self.chat(other)
        await waits
        waits = slots_of(other).entered()
        leaving = self.chat(other)
        await waits
        gone: Deferred[None] = Deferred()

        def left(event: dict[str, Any]) -> None:
            if not gone.called and event.get("access", {}).get("ended") == "client_left":
                gone.callback(None)

        self._observe(left)
        leaving.cancel()  # its client goes away while it waits
        leaving.addErrback(lambda failure: failure.trap(ResponseNeverReceived))
        await gone
        assert len(slots_of(other).queue) == 2  # it left the fleet's queue, not timed out
        self.clock.advance(5)  # the other one's queue timeout (the ready one waits on)
        refused = await timing_out
        assert (refused.code, refused.headers.getRawHeaders("Retry-After")) == (503, ["1"])
        assert b"queue_timeout" in await refused.content()
        assert [w.ticket.is_ready for w in slots_of(other).queue.waiting()] == [True]
        self.decode.release()
        await held.done
        went = await ahead
        assert went.code == 200
        await went.content()
        await replicas_of(other).beat()
        answered = await self.chat(other)  # nothing of theirs is left waiting ahead of it
        assert answered.code == 200
        await answered.content()
        assert len(self.decode.requests_for("decode")) == 3
        queue = slots_of(other).queue
        assert (len(queue), queue._waiting) == (0, 0)

    async def test_the_fleets_waiting_gauge_falls_to_0_when_the_fleet_is_idle(self) -> None:
        """Set from this replica's own placements alone, it kept what its last one saw
        (the other replica's requests still waiting) on a fleet gone idle."""
        other = await self.two()
        held = await self.held_stream()
        waits = slots_of(other).entered()
        theirs = self.chat(other)
        await waits  # the fleet's first waiting request, on the other replica
        waits = slots_of(self.proxy).entered()
        mine = self.post("/v1/chat/completions", CHAT)
        await waits  # and this replica's, behind it
        gauge = replicas_of(other).metrics.fleet_waiting._value
        self.decode.release()
        await held.done
        for answered in (await theirs, await mine):
            assert answered.code == 200
            await answered.content()
        for each in (other, self.proxy):
            await replicas_of(each).beat()
        assert gauge.get() == replicas_of(self.proxy).metrics.fleet_waiting._value.get() == 0


class FleetMigrationTests(FleetCase):
    async def test_a_moved_answer_gives_its_slot_back_and_takes_the_next_through_redis(
        self,
    ) -> None:
        other = await self.two(decodes=2)
        first, second = self.decodes
        first.die_after_next(2)
        second.hold_streams_after(2)  # the continuation (its role dropped) holds after a token
        held = second.stream_held()
        response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))
        stream = ChunkCollector()
        response.deliverBody(stream)
        await held
        mine, theirs = shared_of(self.proxy), shared_of(other)
        # The lease on the instance that failed went back to Redis; the next one was taken.
        assert list(mine.leases.values()) == [f"decode|{second.url}"]
        await replicas_of(other).beat()
        assert theirs.view == {f"decode|{second.url}": 1}
        second.release()
        await stream.done
        assert sse_events(stream.body)[-1] == "[DONE]"
        assert mine.leases == {}
        await replicas_of(other).beat()
        assert theirs.view == {}


class FleetTenantsTests(FleetCase):
    async def test_a_tenants_requests_in_flight_are_counted_over_every_replica(self) -> None:
        other = await self.two(tenant_header="x-team", tenant_max_in_flight=1)
        self.decode.hold_streams_after(1)
        held = self.decode.stream_held()
        first = await self.post("/v1/chat/completions", dict(CHAT, stream=True), {"x-team": "a"})
        self.addCleanup(self.decode.release)
        await held
        refused = await self.chat(other, headers={"x-team": "a"})
        assert refused.code == 429  # its one request in flight is on the other replica
        assert b"1 request in flight" in await refused.content()
        self.decode.release()
        await first.content()
        other_team = await self.chat(other, headers={"x-team": "b"})
        assert other_team.code == 200
        await other_team.content()

    async def test_tenants_waiting_on_different_replicas_share_the_slots_by_weight(self) -> None:
        tenants = {"a": {"weight": 3}, "b": {"weight": 1}}
        # Prefill runs one ahead of the one decode slot (the fleet's limit): the first is
        # prefilled at once, the others wait for their prefill slot in the fleet's order.
        settings: dict[str, Any] = {"tenant_header": "x-team", "tenants": json.dumps(tenants)}
        other = await self.two(**settings)
        held = await self.held_stream()  # the one decode slot
        waiting: list[Deferred[Any]] = []
        for proxy, team in [(other, "b")] * 4 + [(self.proxy, "a")] * 4:
            waits = slots_of(proxy).entered()
            body = dict(CHAT, user=f"{team}-{len(waiting)}")
            waiting.append(self.chat(proxy, body, {"x-team": team}))
            await waits
        self.decode.release()
        for answered in waiting:
            response = await answered
            assert response.code == 200
            await response.content()
        await held.done
        served = [(r.body or {}).get("user", "")[:1] for r in self.decode.requests_for("decode")]
        # Let go in the fleet's order whichever replica held them: b's first at once (the
        # clock at 1), then by tags, a's a third apart from 4/3, b's one apart from 2 (a tie
        # to the first to come): not the order they came in.
        assert served[1:] == ["b", "a", "a", "b", "a", "a", "b", "b"]
