"""Replicas on a real Redis run prefill ahead of decode under the fleet's limit: a replica
may take more than its half of it while the other holds none, and the limit still holds
over both, counting what each holds in prefill and in the ready lane."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, DeferredList

from nixl_twisted.admission.waiting import READY_SUFFIX
from nixl_twisted.testing import RunningProxy
from tests.loopback.test_replicas import replicas_of, shared_of, slots_of
from tests.loopback.test_replicas_heal import HealCase
from tests.support import CHAT


class FleetAheadTests(HealCase):
    def ahead(self, proxy: RunningProxy) -> int:
        return slots_of(proxy).run_ahead.ahead(None)

    async def prefilled_or_waiting(self, proxy: RunningProxy, body: object = CHAT) -> Any:
        """A request through ``proxy``: the index of what came first, its prefill held (0)
        or its wait for a slot (1), and its answer."""
        held, waits = self.prefill.stream_held(), slots_of(proxy).entered()
        answer = self.chat(proxy, body)
        _, first = await DeferredList([held, waits], fireOnOneCallback=True)
        return first, answer

    async def test_a_replica_runs_past_its_half_and_the_fleets_limit_holds_over_both(
        self,
    ) -> None:
        self.other = await self.forging(decode_max_in_flight=4, prefill_max_in_flight=8)
        self.prefill.hold_answers()
        answers: list[Deferred[Any]] = []
        for _ in range(3):  # past its half (2) of the fleet's limit (the 4 decode slots)
            first, answer = await self.prefilled_or_waiting(self.other)
            answers.append(answer)
            assert first == 0
        assert self.ahead(self.other) == 3 and self.ahead(self.proxy) == 0
        first, answer = await self.prefilled_or_waiting(self.proxy)
        answers.append(answer)
        assert first == 0  # the fleet's fourth
        assert slots_of(self.proxy).run_ahead.limit(None) == 4
        first, answer = await self.prefilled_or_waiting(self.proxy)
        answers.append(answer)
        assert first == 1  # (1 of its half: the fleet's 4 hold it back)
        assert len(self.prefill.requests_for("prefill")) == 4
        self.prefill.release()
        for answer in answers:
            response = await answer
            assert response.code == 200
            await response.content()
        assert len(self.prefill.requests_for("prefill")) == 5

    async def test_the_other_replicas_ready_requests_count_against_the_limit(self) -> None:
        self.other = await self.forging(decode_max_in_flight=4, prefill_max_in_flight=8)
        self.decode.hold_streams_after(1)
        self.addCleanup(self.decode.release)
        streams: list[Deferred[Any]] = []
        for _ in range(4):  # the fleet's four decode slots (not ahead: decoding)
            held = self.decode.stream_held()
            streams.append(self.chat(self.other, dict(CHAT, stream=True)))
            await held
        for proxy in (self.other,) * 3 + (self.proxy,):  # 3 ready in one replica, 1 in the other
            waits = slots_of(proxy).entered()
            streams.append(self.chat(proxy, dict(CHAT, stream=True)))
            await waits
        assert (self.ahead(self.other), self.ahead(self.proxy)) == (3, 1)
        waits = slots_of(self.proxy).entered()
        streams.append(self.chat(self.proxy, dict(CHAT, stream=True)))
        await waits  # (its own one and the other's three: the fleet's limit of 4)
        assert len(self.prefill.requests_for("prefill")) == 8
        waiting = sorted(w.ticket.is_ready for w in slots_of(self.proxy).queue.waiting())
        assert waiting == [False, True]  # (held back before its prefill)
        self.decode.release()
        for stream in streams:
            response = await stream
            assert response.code == 200
            await response.content()

    async def test_a_replica_hears_the_others_ready_lane_from_messages(self) -> None:
        self.other = await self.forging(decode_max_in_flight=4, prefill_max_in_flight=8)
        self.decode.hold_streams_after(1)
        self.addCleanup(self.decode.release)
        streams: list[Deferred[Any]] = []
        for _ in range(4):  # the fleet's four decode slots
            held = self.decode.stream_held()
            streams.append(self.chat(self.other, dict(CHAT, stream=True)))
            await held
        heard: Deferred[None] = Deferred()

        def told(changed: dict[str, int], version: int | None) -> None:
            if changed.get(READY_SUFFIX) == 4 and not heard.called:
                heard.callback(None)

        replicas_of(self.proxy).on_freed(told)
        for _ in range(4):  # the fleet's limit, all of it ready in one replica
            waits = slots_of(self.other).entered()
            streams.append(self.chat(self.other, dict(CHAT, stream=True)))
            await waits
        await heard  # (told on ``freed``: no answer of its own said it)
        assert shared_of(self.proxy).ready == {"": 4}
        waits = slots_of(self.proxy).entered()
        streams.append(self.chat(self.proxy, dict(CHAT, stream=True)))
        await waits
        assert len(self.prefill.requests_for("prefill")) == 8  # (held back before its prefill)
        self.decode.release()  # the ready ones decode: messages say the lane emptied
        for stream in streams:
            response = await stream
            assert response.code == 200
            await response.content()
        assert len(self.prefill.requests_for("prefill")) == 9
