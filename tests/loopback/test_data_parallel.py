"""Data-parallel ranks: URL#dp=N is N instances, each leg to one carries its rank header."""

from __future__ import annotations

import json

from tests.support import CHAT, ProxyCase


class DataParallelTests(ProxyCase):
    async def test_each_rank_is_an_instance_and_each_leg_names_its_rank(self) -> None:
        await self.start()
        await self.proxy.stop()
        prefill, decode = self.prefill.url, self.decode.url
        self.proxy = self.start_proxy([prefill + "#dp=2"], [decode + "#dp=3"])
        backends = self.proxy.service.backends
        self.assertEqual(backends.decode.urls, tuple(f"{decode}#rank={r}" for r in range(3)))
        for _ in range(6):
            response, _ = await self.post_json("/v1/chat/completions", CHAT)
            self.assertEqual(response.code, 200)

        def ranks(fake: object, role: str) -> list[str]:
            return [r.headers.getRawHeaders(b"x-data-parallel-rank")[0].decode()
                    for r in fake.requests_for(role)]  # type: ignore[attr-defined]  # fmt: skip

        self.assertEqual(ranks(self.prefill, "prefill"), ["0", "1"] * 3)
        self.assertEqual(ranks(self.decode, "decode"), ["0", "1", "2"] * 2)
        # Each rank has its own health, metrics and place in /healthcheck.
        health = json.loads(await (await self.http.get(self.proxy.url + "/healthcheck")).text())
        self.assertEqual([i["rank"] for i in health["instances"]["decode"]], [0, 1, 2])
        metrics = await (await self.http.get(self.proxy.url + "/metrics")).text()
        self.assertIn(f'instance="{decode}#rank=2",outcome="answered",pool="decode"}} 2.0', metrics)

    async def test_a_client_never_chooses_the_rank(self) -> None:
        await self.start()
        await self.proxy.stop()
        self.proxy = self.start_proxy([self.prefill.url], [self.decode.url + "#dp=2"])
        for _ in range(2):
            response, _ = await self.post_json(
                "/v1/chat/completions", CHAT, {"X-data-parallel-rank": "7"}
            )
            self.assertEqual(response.code, 200)
        sent = [r.headers.getRawHeaders(b"x-data-parallel-rank") for r in self.prefill.requests]
        self.assertEqual(sent, [None, None])  # no #dp: no rank at all
        sent = [r.headers.getRawHeaders(b"x-data-parallel-rank") for r in self.decode.requests]
        self.assertEqual(sent, [[b"0"], [b"1"]])  # the proxy's, once

    async def test_the_admin_api_adds_and_drains_all_ranks_at_once(self) -> None:
        await self.start(proxy=dict(admin_token="t"))
        admin = {"Authorization": "Bearer t"}
        url = self.decode.url.replace("127.0.0.1", "localhost") + "#dp=2"
        response, answer = await self.post_json(
            "/admin/backends", {"pool": "decode", "url": url}, admin
        )
        self.assertEqual(response.code, 201)
        self.assertEqual([i["rank"] for i in answer["instances"]], [0, 1])
        response, answer = await self.post_json(
            "/admin/backends/drain", {"pool": "decode", "url": url}, admin
        )
        self.assertEqual((response.code, len(answer["instances"])), (202, 2))
        self.assertEqual(self.proxy.service.backends.decode.urls, (self.decode.url,))
