"""``--replicas-redis`` between real ``twistd nixlproxy`` processes and a real redis-server:
a cap holds for two replicas, a replica stopped with SIGTERM serves what waits in its queue
and signs out, a replica killed with SIGKILL gives its slot back within its
heartbeat's life, Redis stopped and started again costs no request, ``rediss://`` with a
certificate made in the test shares as well, and ``--workers`` are replicas too."""

from __future__ import annotations

import json
import os
import re
import signal
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred

from nixl_twisted.fleet.link import RedisLink
from nixl_twisted.fleet.replies import prefix_of
from nixl_twisted.testing import TwistdProtocol
from tests.process.support import TwistdCase
from tests.support import CHAT, real_redis

SHARES = b"shares caps, queue and tenants with"


class ReplicaProcessTests(TwistdCase):
    def fleet(self, redis_url: str) -> tuple[str, ...]:
        """The fakes, the decode instance capped at one slot, shared through ``redis_url``."""
        return (
            *("--prefill", self.prefill.url, "--decode", self.decode.url),
            *("--decode-max-in-flight", "1", "--replicas-redis", redis_url),
        )

    async def replica(self, redis_url: str, *more: str) -> tuple[TwistdProtocol, str]:
        """A replica before the fakes, once it listens and shares the fleet's state."""
        process = self.spawn("--listen", "tcp:0:interface=127.0.0.1", *self.fleet(redis_url), *more)
        address = await process.listening
        await process.said(SHARES)
        return process, f"http://{address}"

    def chat(self, url: str, body: object = CHAT) -> Deferred[Any]:
        headers: dict[bytes | str, bytes | str] = {"Content-Type": "application/json"}
        client = self.fresh_connections()
        return client.post(
            url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
        )

    async def held(self, url: str) -> Any:
        """A stream through ``url`` that decode holds after its first event: the one slot."""
        self.decode.hold_streams_after(1)
        held = self.decode.stream_held()
        response = await self.chat(url, dict(CHAT, stream=True))
        await held
        return response

    async def test_a_replica_killed_gives_its_slot_back_within_its_heartbeats_life(self) -> None:
        redis = await real_redis(self)
        await self.start()
        first, first_url = await self.replica(redis.url)
        second, second_url = await self.replica(redis.url)
        await self.held(first_url)
        waiting = self.chat(second_url)  # the fleet's one decode slot is the first's
        os.kill(first.transport.pid, signal.SIGKILL)  # type: ignore[union-attr]
        await first.ended
        await second.said(b"stopped beating; what it held is given back (1 slot in all)")
        self.decode.release()  # (the killed replica's stream is cut; the fake holds no more)
        response = await waiting
        assert response.code == 200
        await response.content()
        assert len(self.decode.requests_for("decode")) == 2
        await self.terminate(second)

    async def test_sigterm_serves_what_waits_then_signs_out_of_redis(self) -> None:
        redis = await real_redis(self)
        await self.start()
        first, first_url = await self.replica(redis.url, "--shutdown-delay", "1")
        second, second_url = await self.replica(redis.url)
        found = re.search(rb"replica (\w+) shares caps", first.output)
        assert found is not None
        await self.held(second_url)  # the fleet's one decode slot is the second's
        waiting = self.chat(first_url)
        os.kill(first.transport.pid, signal.SIGTERM)  # type: ignore[union-attr]
        # The delay has ended and the request still waits for the slot: it is not refused.
        await first.said(b"draining 1 request in flight")
        self.decode.release()
        response = await waiting
        assert response.code == 200
        await response.content()
        self.assertEqual(await first.ended, 0, first.output.decode())
        # Signed out as it stopped: no longer alive for the others, 3 s before its TTL.
        link = RedisLink(redis.url, reactor, lambda why: None)
        link.start()
        self.addCleanup(link.stop)
        alive = await link.command("ZRANGE", prefix_of(redis.url) + "alive", 0, -1)
        assert found[1].decode() not in alive and len(alive) == 1
        assert b"signed out of Redis" in first.output
        assert b"could not be reached" not in first.output
        assert b"replicas#warn" not in first.output
        await self.terminate(second)

    async def test_redis_stopped_and_started_again_costs_no_request(self) -> None:
        redis = await real_redis(self)
        await self.start()
        first, first_url = await self.replica(redis.url)
        second, second_url = await self.replica(redis.url)
        await redis.stop()
        for process in (first, second):
            await process.said(b"queues alone until it answers again")
        for url in (first_url, second_url):
            response = await self.chat(url)
            assert response.code == 200  # (each alone: the cap of 1 is each one's share)
            await response.content()
        await redis.start()  # (on the same port, its memory empty)
        for process in (first, second):
            await process.said(b"(it answers again)")
        # Shared again, each having written back what it holds: one slot for both.
        await self.held(first_url)
        waiting = self.chat(second_url)
        self.decode.release()
        response = await waiting
        assert response.code == 200
        await response.content()
        assert len(self.decode.requests_for("decode")) == 4
        for process in (first, second):
            await self.terminate(process)

    async def test_replicas_share_through_redis_over_verified_tls(self) -> None:
        redis = await real_redis(self, tls_for="127.0.0.1")
        await self.start()
        first, first_url = await self.replica(redis.tls_url)  # (trusting its certificate)
        second, second_url = await self.replica(redis.tls_url)
        await self.held(first_url)
        waiting = self.chat(second_url)  # the fleet's one decode slot is the first's
        assert len(self.decode.requests_for("decode")) == 1
        self.decode.release()
        response = await waiting
        assert response.code == 200
        await response.content()
        assert len(self.decode.requests_for("decode")) == 2
        for process in (first, second):
            await self.terminate(process)

    async def test_workers_are_replicas_of_one_proxy(self) -> None:
        redis = await real_redis(self)
        await self.start()
        process, address = await self.spawn_workers(*self.fleet(redis.url))
        await process.said(SHARES, times=2)  # each worker is a replica
        url = f"http://{address}"
        await self.held(url)
        waiting = [self.chat(url) for _ in range(4)]  # whichever worker takes them: they wait
        assert len(self.decode.requests_for("decode")) == 1
        self.decode.release()
        for answered in waiting:
            response = await answered
            assert response.code == 200
            await response.content()
        assert len(self.decode.requests_for("decode")) == 5
        await self.terminate(process)
