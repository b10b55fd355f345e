"""``rediss://`` against a real redis-server listening for TLS: the proxy connects when the
server's certificate is for the URL's host and signed by a CA it trusts (``ssl_ca_certs``),
and otherwise refuses the connection before it says a word (no ``AUTH``), saying why in
words: a name mismatch, or a certificate verify failure."""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.admission.windows import SharedWindows
from nixl_twisted.testing import RunningProxy
from nixl_twisted.testing.redis import RedisServer
from tests.support import CHAT, ProxyCase, real_redis

KEY = "sk-team-a"


class RedisTLSTests(ProxyCase):
    timeout = 20

    async def limited(self, url: str) -> RunningProxy:
        """The fakes, and a proxy counting team-a's requests in the Redis at ``url``."""
        where = Path(tempfile.mkdtemp(prefix="nixlproxy-keys-"))
        self.addCleanup(shutil.rmtree, where)
        (where / "keys").write_text(f"{KEY} team-a\n")
        settings = {"api_keys_file": str(where / "keys"), "limits_redis": url}
        await self.start(tokens=4, proxy=dict(settings, tenant_requests_per_minute=5))
        return self.proxy

    def windows(self, proxy: RunningProxy) -> SharedWindows:
        shared = proxy.app.tenancy.shared
        assert shared is not None
        return shared

    async def admin(self, redis: RedisServer, *command: str) -> Any:
        """``command``'s answer on Redis's plain port, through a connection of the test's."""
        txredisapi = importlib.import_module("txredisapi")
        connection = await txredisapi.Connection("127.0.0.1", redis.port, password="right")
        try:
            return await connection.execute_command(*command)
        finally:
            await connection.disconnect()

    async def auths(self, redis: RedisServer) -> int:
        """How many AUTH commands Redis was sent, the test's own included."""
        stats = await self.admin(redis, "INFO", "commandstats")
        for line in stats.splitlines():
            if line.startswith("cmdstat_auth:"):
                return int(line.split("calls=")[1].split(",")[0])
        return 0

    async def refused_before_auth(self, redis: RedisServer, url: str) -> str:
        """Why the proxy refused ``url`` (a password in it), once it has, and that it said
        so in its log; the AUTH counted is the test's own."""
        events = self.logged()
        one = await self.limited(url)
        refused = await self.windows(one).link.refused()
        said = [e["what"] for e in events if "counts its own" in str(e.get("log_format"))]
        self.assertEqual(len(said), 1)
        self.assertIn(refused, said[0])
        self.assertEqual(await self.auths(redis), 1)
        self.assertFalse(self.windows(one).link.open)
        return refused

    async def test_limits_are_shared_over_verified_tls(self) -> None:
        redis = await real_redis(self, "--requirepass", "right", tls_for="127.0.0.1")
        url = redis.tls_url.replace("rediss://", "rediss://:right@")
        one = await self.limited(url)
        await self.windows(one).connected()
        client = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        headers: dict[bytes | str, bytes | str] = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {KEY}",
        }
        response = await client.post(
            one.url + "/v1/chat/completions", data=json.dumps(CHAT).encode(), headers=headers
        )
        await response.content()
        self.assertEqual(response.code, 200)
        clients = await self.admin(redis, "CLIENT", "LIST")
        on_tls = [line for line in clients.splitlines() if f":{redis.tls_port} " in line]
        self.assertEqual(len(on_tls), 1)  # (the proxy's, on the TLS port)
        self.assertIn("cmd=eval", on_tls[0])  # (its admission, counted in Redis)

    async def test_a_certificate_for_another_name_is_refused_before_auth(self) -> None:
        redis = await real_redis(self, "--requirepass", "right", tls_for="attacker.invalid")
        url = redis.tls_url.replace("rediss://", "rediss://:right@")  # (trusting it)
        refused = await self.refused_before_auth(redis, url)
        self.assertEqual(
            refused, "TLS: the server's certificate is not for 127.0.0.1 (name mismatch)"
        )

    async def test_an_untrusted_certificate_is_refused_before_auth(self) -> None:
        redis = await real_redis(self, "--requirepass", "right", tls_for="127.0.0.1")
        url = f"rediss://:right@127.0.0.1:{redis.tls_port}/0"  # (the system's CAs)
        refused = await self.refused_before_auth(redis, url)
        self.assertEqual(refused, "TLS with 127.0.0.1 failed: certificate verify failed")
