"""``--replicas-redis`` with replicas started with other caps: the fleet holds each instance
to one cap (the lowest of the live replicas'), and the replica whose cap differs says so."""

from __future__ import annotations

import json

from twisted.logger import formatEvent

from nixl_twisted.testing import RunningProxy
from tests.loopback.test_replicas import FleetCase, replicas_of, shared_of, slots_of


class FleetCapTests(FleetCase):
    async def lapse(self, proxy: RunningProxy) -> None:
        """``proxy``'s replica stops, its heartbeat lapsed at once (as one killed)."""
        replica = replicas_of(proxy)
        replica.ttl = 0.0
        await replica.beat()
        await replica.stopService()

    async def test_two_replicas_with_other_caps_never_run_more_than_the_lowest(self) -> None:
        said: list[str] = []
        self._observe(
            lambda e: said.append(formatEvent(e)) if "another replica" in formatEvent(e) else None
        )
        other = await self.two(decode_max_in_flight=1)  # (both at 1 first)
        await replicas_of(other).stopService()
        roomy = self.start_proxy(
            [f.url for f in self.prefills],
            [f.url for f in self.decodes],
            **dict(self.settings, decode_max_in_flight=3),
        )
        await replicas_of(roomy).ready()
        await shared_of(roomy).caps_read()
        url = self.decode.url
        where = f"decode|{url}"
        assert shared_of(roomy).fleet_caps[where].lowest == 1
        # Said at its start: the instance and both caps.
        assert len(said) == 1 and url in said[0]
        assert "cap is 3" in said[0] and "is 1" in said[0] and "holds it to 1" in said[0]
        metrics = replicas_of(roomy).metrics
        labels = {"pool": "decode", "instance": url}
        assert metrics.cap_mismatch.labels(**labels)._value.get() == 1
        assert metrics.fleet_cap.labels(**labels)._value.get() == 1

        held = await self.held_stream()  # the fleet's one decode slot, through the first
        waits = slots_of(roomy).entered()
        second = self.chat(roomy)
        await waits  # its own cap of 3 would let it go: the fleet's 1 holds it
        assert len(self.decode.requests_for("decode")) == 1

        status = await self.http.get(roomy.url + "/status.json")
        shown = json.loads(await status.content())["instances"]["decode"][0]
        assert shown["fleet_cap"] == {"held": 1, "highest": 3}
        page = await (await self.http.get(roomy.url + "/")).content()
        assert b"caps differ: 1 to 3" in page

        self.decode.release()
        response = await second
        assert response.code == 200
        await response.content()
        await held.done
        assert len(self.decode.requests_for("decode")) == 2

    async def test_the_cap_rises_when_the_replica_with_the_lowest_leaves(self) -> None:
        other = await self.two(decode_max_in_flight=2)
        await self.lapse(other)
        roomy = self.start_proxy(
            [f.url for f in self.prefills],
            [f.url for f in self.decodes],
            **dict(self.settings, decode_max_in_flight=3),
        )
        await replicas_of(roomy).ready()
        await shared_of(roomy).caps_read()
        where = f"decode|{self.decode.url}"
        assert shared_of(roomy).fleet_caps[where].lowest == 2
        await self.lapse(self.proxy)
        await replicas_of(roomy).beat()  # forgets it, and its caps
        await shared_of(roomy).caps_read()
        assert shared_of(roomy).fleet_caps[where].lowest == 3
        assert roomy.app.view.backends.decode.instances[0].slots == 3
