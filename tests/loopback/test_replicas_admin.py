"""``--replicas-redis``: a change made through one replica's admin API (drain, remove, add)
is made on every replica within a round trip, and by a replica that starts later; what is
read from Redis is checked (a line that does not parse ignored and counted, an instance
added held to each replica's --allowed-backends)."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor

from nixl_twisted.fleet.admin_changes import FleetAdmin
from nixl_twisted.fleet.link import RedisLink
from nixl_twisted.fleet.replies import prefix_of
from nixl_twisted.testing import RunningProxy
from tests.loopback.test_replicas import FleetCase, replicas_of

TOKEN = "admin-token"
AUTHORIZED: dict[bytes | str, bytes | str] = {"Authorization": f"Bearer {TOKEN}"}


def admin_of(proxy: RunningProxy) -> FleetAdmin:
    found = proxy.service.getServiceNamed("fleet-admin")
    assert isinstance(found, FleetAdmin)
    return found


class FleetAdminTests(FleetCase):
    async def fleet(self, **settings: Any) -> RunningProxy:
        return await self.two(decodes=2, admin_token=TOKEN, decode_max_in_flight=0, **settings)

    async def admin(self, proxy: RunningProxy, op: str, url: str, method: str = "POST") -> int:
        path = "/admin/backends/drain" if op == "drain" else "/admin/backends"
        response = await self.http.request(
            method,
            proxy.url + path,
            json={"pool": "decode", "url": url},
            headers=AUTHORIZED,
        )
        await response.content()
        return int(response.code)

    def decodes_of(self, proxy: RunningProxy) -> dict[str, bool]:
        """Each decode instance of ``proxy``'s pool, and whether it drains."""
        return {i.url: i.draining for i in proxy.app.view.backends.decode.instances}

    async def served_by(self, proxy: RunningProxy, count: int) -> set[str]:
        before = {f.url: len(f.requests_for("decode")) for f in self.decodes}
        for _ in range(count):
            response = await self.chat(proxy)
            assert response.code == 200
            await response.content()
        return {f.url for f in self.decodes if len(f.requests_for("decode")) > before[f.url]}

    async def test_a_drain_on_one_replica_reaches_the_other_at_once(self) -> None:
        other = await self.fleet()
        kept, drained = (f.url for f in self.decodes)
        assert await self.served_by(other, 4) == {kept, drained}
        made = admin_of(other).made()
        assert await self.admin(self.proxy, "drain", drained) == 202
        await made  # (its message on the channel: no heartbeat waited for)
        assert drained not in self.decodes_of(other)  # (no legs: drained and gone at once)
        assert await self.served_by(other, 4) == {kept}
        metrics = replicas_of(other).metrics.admin_changes
        assert metrics.labels(outcome="applied")._value.get() == 1
        assert (
            replicas_of(self.proxy).metrics.admin_changes.labels(outcome="told")._value.get() == 1
        )

    async def test_a_replica_started_later_makes_the_fleets_changes(self) -> None:
        other = await self.fleet()
        kept, removed = (f.url for f in self.decodes)
        made = admin_of(other).made()
        assert await self.admin(self.proxy, "remove", removed, "DELETE") == 200
        await made
        later = self.start_proxy(
            [f.url for f in self.prefills], [f.url for f in self.decodes], **self.settings
        )
        made = admin_of(later).made()
        await replicas_of(later).ready()
        await made  # (its first heartbeat read the fleet's changes)
        assert list(self.decodes_of(later)) == [kept]  # the removal wins over its --decode
        # Taken back through the admin API, for every replica again.
        made = admin_of(later).made()
        assert await self.admin(other, "add", removed) == 201
        await made
        assert set(self.decodes_of(later)) == {kept, removed}

    async def test_what_redis_holds_is_checked(self) -> None:
        other = await self.fleet(allowed_backends=["127.0.0.1/32"])
        link = RedisLink(self.redis.url, reactor, lambda why: None)
        link.start()
        self.addCleanup(link.stop)
        channel = prefix_of(self.redis.url) + "admin"
        kept, drained = (f.url for f in self.decodes)
        for forged in ("v1\t1\tdrain\tdecode", "v2\t1\tdrain\tdecode\thttp://x:1\tr", "\x00" * 10):
            await link.command("PUBLISH", channel, forged)
        # A forged add outside --allowed-backends is not made; the next good line is.
        made = admin_of(other).made()
        await link.command("PUBLISH", channel, "v1\t900\tadd\tdecode\thttp://10.9.9.9:80\tforger")
        await made
        made = admin_of(other).made()
        await link.command("PUBLISH", channel, f"v1\t901\tdrain\tdecode\t{drained}\tforger")
        await made
        assert list(self.decodes_of(other)) == [kept]
        outcomes = replicas_of(other).metrics.admin_changes
        assert outcomes.labels(outcome="malformed")._value.get() == 3
        assert outcomes.labels(outcome="not_allowed")._value.get() == 1
        # An older change never undoes a newer one.
        await link.command("PUBLISH", channel, f"v1\t5\tadd\tdecode\t{drained}\tforger")
        await replicas_of(other).beat()
        assert list(self.decodes_of(other)) == [kept]
