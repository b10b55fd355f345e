"""``--replicas-redis`` and first-token targets: the fleet's queue refuses a request
predicted to miss its target, by the fleet's waiting count and grants, on a real Redis."""

from __future__ import annotations

from tests.loopback.test_replicas import FleetCase, slots_of


class FleetDeadlinesTests(FleetCase):
    async def test_a_request_predicted_to_miss_behind_the_fleets_queue_is_refused(self) -> None:
        other = await self.two()
        for _ in range(8):  # (the fleet's grants: how fast its decode slots free)
            answered = await self.chat(other)
            assert answered.code == 200
            await answered.content()
        held = await self.held_stream()  # (the decode slot, through the first replica)
        waiting = []
        for _ in range(20):
            waits = slots_of(other).entered()
            waiting.append(self.chat(other))
            await waits
        refused = await self.chat(other, headers={"x-slo-ttft-ms": "1"})
        assert refused.code == 503
        assert b"ttft_unreachable" in await refused.content()
        assert refused.headers.getRawHeaders("Retry-After") is not None
        patient = self.chat(other, headers={"x-slo-ttft-ms": "60000"})  # (it will make it)
        self.decode.release()
        await held.done
        for each in (*waiting, patient):
            answered = await each
            assert answered.code == 200
            await answered.content()
