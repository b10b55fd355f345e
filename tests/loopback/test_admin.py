"""Live backend changes: the admin API and pool updates, with requests in flight."""

from __future__ import annotations

import json
from typing import Any

from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from zope.interface import provider

from nixl_twisted.testing import FakeVLLM
from tests.support import CHAT, ChunkCollector, ProxyCase, sse_events

TOKEN = "admin-secret-token"
STREAM = dict(CHAT, stream=True)


class AdminCase(ProxyCase):
    async def admin(
        self,
        method: str,
        path: str,
        body: object | None = None,
        token: str | None = TOKEN,
        authorization: str | None = None,
    ) -> tuple[int, Any]:
        """``authorization``: the header's whole value, instead of ``Bearer`` and ``token``."""
        headers: dict[str | bytes, str | bytes] = {}
        if authorization is not None:
            headers["Authorization"] = authorization
        elif token:
            headers["Authorization"] = f"Bearer {token}"
        response = await self.http.request(
            method,
            self.proxy.url + path,
            data=json.dumps(body).encode() if body is not None else None,
            headers=headers,
        )
        return response.code, json.loads(await response.content())

    async def completion(self) -> int:
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        return int(response.code)

    async def new_decode(self) -> FakeVLLM:
        fake = FakeVLLM(name="decode-new", ledger=self.ledger)
        await fake.listen()
        self.addCleanup(fake.stop)
        return fake


class AdminAuthTests(AdminCase):
    async def test_no_token_configured_means_no_admin_api(self) -> None:
        await self.start()
        code, _ = await self.admin("GET", "/admin/backends")
        self.assertEqual(code, 404)

    async def test_missing_or_wrong_token_is_401_and_logged_without_the_token(self) -> None:
        lines: list[str] = []

        @provider(ILogObserver)
        def observe(event: dict[str, Any]) -> None:
            lines.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        await self.start(proxy=dict(admin_token=TOKEN))
        for token in (None, "wrong-token"):
            code, answer = await self.admin("GET", "/admin/backends", token=token)
            self.assertEqual(code, 401)
            self.assertEqual(answer["error"]["code"], "unauthorized")
        refusals = [line for line in lines if "admin API refused" in line]
        self.assertEqual(len(refusals), 2)
        self.assertFalse(any("wrong-token" in line or TOKEN in line for line in lines))

    async def test_only_the_bearer_scheme_carries_the_token(self) -> None:
        await self.start(proxy=dict(admin_token=TOKEN))
        for authorization, expected in (
            (f"Bearer {TOKEN}", 200),
            (f"bearer {TOKEN}", 200),  # a scheme is case-insensitive
            (f"BEARER   {TOKEN}", 200),  # one or more spaces
            (TOKEN, 401),
            (f"Basic {TOKEN}", 401),
            (f"Bearer{TOKEN}", 401),
            (f"Bearer {TOKEN}x", 401),
            ("Bearer ", 401),
        ):
            code, _ = await self.admin("GET", "/admin/backends", authorization=authorization)
            self.assertEqual(code, expected, authorization)

    async def test_the_right_token_lists_instances(self) -> None:
        await self.start(decodes=2, proxy=dict(admin_token=TOKEN))
        code, answer = await self.admin("GET", "/admin/backends")
        self.assertEqual(code, 200)
        self.assertEqual([i["url"] for i in answer["decode"]], [d.url for d in self.decodes])
        self.assertEqual(answer["prefill"][0]["in_flight"], 0)
        self.assertFalse(answer["prefill"][0]["draining"])


class AdminChangeTests(AdminCase):
    async def test_add_then_remove_a_decode_instance(self) -> None:
        await self.start(proxy=dict(admin_token=TOKEN))
        fresh = await self.new_decode()
        code, added = await self.admin(
            "POST", "/admin/backends", {"pool": "decode", "url": fresh.url}
        )
        self.assertEqual((code, added["url"]), (201, fresh.url))
        for _ in range(4):
            self.assertEqual(await self.completion(), 200)
        self.assertEqual((len(self.decode.requests), len(fresh.requests)), (2, 2))

        code, _ = await self.admin(
            "DELETE", "/admin/backends", {"pool": "decode", "url": fresh.url}
        )
        self.assertEqual(code, 200)
        for _ in range(2):
            self.assertEqual(await self.completion(), 200)
        self.assertEqual(len(fresh.requests), 2)

    async def test_a_drained_instance_finishes_its_stream_then_leaves(self) -> None:
        await self.start(decodes=2, tokens=3, proxy=dict(admin_token=TOKEN))
        busy, other = self.decodes
        busy.hold_streams_after(1)
        held = busy.stream_held()
        response = await self.post("/v1/chat/completions", STREAM)  # goes to decode-0
        collector = ChunkCollector()
        response.deliverBody(collector)
        await held

        code, drained = await self.admin(
            "POST", "/admin/backends/drain", {"pool": "decode", "url": busy.url}
        )
        self.assertEqual((code, drained["draining"], drained["in_flight"]), (202, True, 1))
        for _ in range(3):
            self.assertEqual(await self.completion(), 200)
        self.assertEqual((len(busy.requests), len(other.requests)), (1, 3))
        _, listing = await self.admin("GET", "/admin/backends")
        self.assertEqual([i["url"] for i in listing["decode"]], [busy.url, other.url])

        busy.release()
        self.assertEqual(sse_events(b"".join(await collector.done))[-1], "[DONE]")
        _, listing = await self.admin("GET", "/admin/backends")
        self.assertEqual([i["url"] for i in listing["decode"]], [other.url])

    async def test_the_last_instance_cannot_be_taken_out(self) -> None:
        await self.start(proxy=dict(admin_token=TOKEN))
        for method, path in (("DELETE", "/admin/backends"), ("POST", "/admin/backends/drain")):
            code, answer = await self.admin(
                method, path, {"pool": "decode", "url": self.decode.url}
            )
            self.assertEqual((code, answer["error"]["code"]), (409, "last_instance"))
        self.assertEqual(await self.completion(), 200)

    async def test_bad_changes_are_4xx(self) -> None:
        await self.start(proxy=dict(admin_token=TOKEN))
        for body, status in (
            ({"pool": "decode", "url": "nope"}, 400),
            ({"pool": "cache", "url": "http://x:1"}, 400),
            ({"pool": "decode"}, 400),
        ):
            code, _ = await self.admin("POST", "/admin/backends", body)
            self.assertEqual(code, status)
        code, _ = await self.admin(
            "DELETE", "/admin/backends", {"pool": "decode", "url": "http://x:1"}
        )
        self.assertEqual(code, 404)

    async def test_a_url_with_cr_lf_is_refused_unstored_and_never_logged_raw(self) -> None:
        events = self.logged()
        await self.start(proxy=dict(admin_token=TOKEN))
        smuggled = f"{self.decode.url}/\r\nX-Injected: 1"
        code, answer = await self.admin(
            "POST", "/admin/backends", {"pool": "decode", "url": smuggled}
        )
        self.assertEqual((code, answer["error"]["code"]), (400, "invalid_url"))
        self.assertIn("whitespace or control characters", answer["error"]["message"])
        _, listing = await self.admin("GET", "/admin/backends")
        self.assertEqual([i["url"] for i in listing["decode"]], [self.decode.url])
        lines = [formatEvent(event) for event in events]
        self.assertTrue(lines)
        self.assertFalse([line for line in lines if "\r" in line or "\n" in line])


class PoolUpdateTests(AdminCase):
    async def test_an_update_adds_new_and_drains_old_without_failing_in_flight(self) -> None:
        await self.start(tokens=3)
        fresh = await self.new_decode()
        collector = await self.held_stream()

        self.proxy.service.backends.decode.update([fresh.url])
        for _ in range(3):
            self.assertEqual(await self.completion(), 200)
        self.assertEqual(len(fresh.requests), 3)
        self.decode.release()
        self.assertEqual(sse_events(b"".join(await collector.done))[-1], "[DONE]")
        self.assertEqual(self.proxy.service.backends.decode.urls, (fresh.url,))
