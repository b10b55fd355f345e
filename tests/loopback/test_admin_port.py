"""``--admin-listen``: the admin API, the full healthcheck and metrics on their own endpoint."""

from __future__ import annotations

import json

from nixl_twisted.run.ports import address
from tests.support import CHAT, ProxyCase

TOKEN = "admin-token"


class AdminPortTests(ProxyCase):
    async def test_the_client_endpoint_keeps_readiness_and_the_admin_one_the_rest(self) -> None:
        await self.start(proxy={"admin_listen": "tcp:0:interface=127.0.0.1", "admin_token": TOKEN})
        client_port, admin_port = self.proxy.service.ports()
        client, admin = f"http://{address(client_port)}", f"http://{address(admin_port)}"
        bearer: dict[bytes | str, bytes | str] = {"Authorization": f"Bearer {TOKEN}"}

        response = await self.http.get(client + "/healthcheck")
        self.assertEqual(
            (response.code, json.loads(await response.content())), (200, {"ready": True})
        )
        response = await self.http.get(client + "/health")
        self.assertEqual((response.code, await response.content()), (200, b""))
        for path in ("/metrics", "/admin/backends", "//admin/backends", "/admin/backends?x=1"):
            response = await self.http.get(client + path, headers=bearer)
            self.assertEqual(response.code, 404, path)
            self.assertEqual(json.loads(await response.content())["error"]["code"], "not_found")
        answered, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(answered.code, 200)

        response = await self.http.get(admin + "/healthcheck")
        full = json.loads(await response.content())
        self.assertEqual(full["instances"]["decode"][0]["url"], self.decode.url)
        self.assertIn("pid", full)
        response = await self.http.get(admin + "/admin/backends", headers=bearer)
        self.assertEqual(response.code, 200)
        self.assertEqual(
            json.loads(await response.content())["prefill"][0]["url"], self.prefill.url
        )
        response = await self.http.get(admin + "/metrics")
        self.assertEqual(response.code, 200)
        self.assertIn(b"nixlproxy_requests_total", await response.content())
        response = await self.http.post(admin + "/v1/chat/completions", json=CHAT)
        self.assertEqual(response.code, 404)  # no client route on the admin endpoint
        await response.content()
        self.assertEqual(len(self.decode.requests), 1)

    async def test_health_says_not_ready_as_vllm_does(self) -> None:
        await self.start()
        self.proxy.app.admission.leaving = True  # (what SIGTERM with --shutdown-delay does)
        response = await self.http.get(self.proxy.url + "/health")
        self.assertEqual((response.code, await response.content()), (503, b""))
        response = await self.http.get(self.proxy.url + "/healthcheck")
        self.assertEqual(response.code, 503)
        self.assertIn("instances", json.loads(await response.content()))  # (no admin endpoint)
