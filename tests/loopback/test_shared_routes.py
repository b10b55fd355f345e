"""One routing view through a real redis-server: what one proxy chose, the others route on.

The scripts against Redis itself (the streams' bounds, a stored response's
instance and its TTL); then two in-process proxies sharing Redis: a
conversation's second turn at the other proxy follows the first turn's
instance by the memory of prefixes sent (``prefix``, not the key's
``affinity``), a ``kv-aware`` prediction reaches the other proxy before any
KV event does, a proxy started again routes on what the fleet sent before
it started, a stored response is found from either proxy, and with Redis
away nothing fails and each proxy keeps its own memory. Each waits for
what it needs (an entry applied, the streams read) and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet import reactor

from nixl_twisted.fleet import messages, route_scripts
from nixl_twisted.fleet.link import RedisLink
from nixl_twisted.fleet.messages import Predicted, Sent
from nixl_twisted.fleet.replicas import Replicas, prefix_of
from nixl_twisted.fleet.routes import SharedRoutes
from nixl_twisted.testing import RunningProxy
from tests.support import ProxyCase, real_redis

DOCUMENT = "A long shared document about prefill, decode and KV blocks. " * 40


def routes_of(proxy: RunningProxy) -> SharedRoutes:
    found = proxy.service.getServiceNamed("shared-routes")
    assert isinstance(found, SharedRoutes)
    return found


def replicas_of(proxy: RunningProxy) -> Replicas:
    found = proxy.service.getServiceNamed("replicas")
    assert isinstance(found, Replicas)
    return found


def turn(history: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "fake-model", "messages": history, "max_tokens": 2}


FIRST = [{"role": "user", "content": DOCUMENT + "\nWhat is it about?"}]
SECOND = [
    *FIRST,
    {"role": "assistant", "content": "Prefill and decode."},
    {"role": "user", "content": "And the KV blocks?"},
]


class ScriptsTests(ProxyCase):
    timeout = 10

    async def link(self) -> RedisLink:
        self.redis = await real_redis(self)
        link = RedisLink(self.redis.url, reactor, lambda why: None)
        connected = link.connected()
        link.start()
        self.addCleanup(link.stop)
        await connected
        self.prefix = prefix_of(self.redis.url)
        return link

    async def share(
        self, link: RedisLink, sent: list[str], predicted: list[str], *stored: str, cap: int = 9
    ) -> Any:
        args = [self.prefix, "r1", len(sent), len(predicted), cap, *sent, *predicted, *stored]
        return await link.eval(route_scripts.SHARE, [], args)

    async def test_the_streams_keep_their_latest_entries_and_a_prediction_its_life(self) -> None:
        link = await self.link()
        stream = self.prefix + route_scripts.PREDICTED
        await link.command("XADD", stream, "1-1", "m", "a prediction long past its life")
        told = messages.entry("r1", [messages.line(Predicted("prefill", "http://p", (1, 2))) or ""])
        for _ in range(3):
            await self.share(link, [], [told] * 100)
        length = await link.command("XLEN", stream)
        # The latest PREDICTED_ENTRIES, give or take one node of the stream (MAXLEN ~).
        self.assertGreaterEqual(length, route_scripts.PREDICTED_ENTRIES)
        self.assertLessEqual(length, route_scripts.PREDICTED_ENTRIES + 100)
        first = await link.command("XRANGE", stream, "-", "+", "COUNT", 1)
        self.assertNotEqual(str(first[0][0]), "1-1")  # older than a prediction's life: gone
        sent = messages.entry("r1", [messages.line(Sent("prefill", "http://p", (7,))) or ""])
        await self.share(link, [sent, sent], [])
        entries = await link.command("XRANGE", self.prefix + route_scripts.SENT, "-", "+")
        self.assertEqual([messages.read(e[1][1]) for e in entries], [messages.read(sent)] * 2)

    async def test_a_stored_responses_instance_and_owner_are_kept_for_an_hour(self) -> None:
        link = await self.link()
        await self.share(link, [], [], "resp_1", "http://d:8200", "alpha", "resp_2", "http://e", "")
        found = [
            await link.eval(route_scripts.RESPONSE, [], [self.prefix, "r2", response])
            for response in ("resp_1", "resp_2", "resp_3")
        ]
        self.assertEqual(found, ["http://d:8200\nalpha", "http://e\n", None])
        for key in ("response:resp_1", "responses:" + hashlib.sha1(b"alpha").hexdigest()):
            ttl = await link.command("PTTL", self.prefix + key)
            self.assertGreater(ttl, route_scripts.RESPONSE_TTL_MS - 5000)
            self.assertLessEqual(ttl, route_scripts.RESPONSE_TTL_MS)

    async def test_each_owner_keeps_its_latest_responses_the_oldest_forgotten(self) -> None:
        link = await self.link()
        for n in range(5):  # (one call each: each stored later than the one before)
            await self.share(link, [], [], f"resp_a{n}", "http://d", "alpha", cap=3)
        await self.share(link, [], [], "resp_b", "http://d", "beta", cap=3)
        kept = await link.command("KEYS", self.prefix + "response:*")
        names = sorted(str(k).removeprefix(self.prefix + "response:") for k in kept)
        self.assertEqual(names, ["resp_a2", "resp_a3", "resp_a4", "resp_b"])
        index = self.prefix + "responses:" + hashlib.sha1(b"alpha").hexdigest()
        self.assertEqual(await link.command("ZCARD", index), 3)


class SharedRoutesTests(ProxyCase):
    timeout = 20

    async def two(self, prefills: int = 2, decodes: int = 1, **settings: Any) -> RunningProxy:
        """Redis, the fakes and two proxies sharing it, each shared once it has beaten."""
        self.redis = await real_redis(self)
        self.settings = {
            "replicas_redis": self.redis.url,
            "prefill_policy": "cache-aware",
            **settings,
        }
        await self.start(prefills=prefills, decodes=decodes, proxy=self.settings)
        other = self.another()
        for each in (self.proxy, other):
            await replicas_of(each).ready()
        return other

    def another(self, prefill: list[str] | None = None) -> RunningProxy:
        urls = prefill or [f.url for f in self.prefills]
        return self.start_proxy(urls, [f.url for f in self.decodes], **self.settings)

    async def ask(self, proxy: RunningProxy, body: dict[str, Any], path: str = "") -> Any:
        response = await self.http.post(
            proxy.url + (path or "/v1/chat/completions"),
            json=body,
        )
        answer = json.loads(await response.content())
        self.assertEqual(response.code, 200, answer)
        return answer

    def routed(self, logged: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """Each completion's prefill instance and why, in order."""
        return [
            (event["access"]["prefill"], event["access"]["prefill_route"])
            for event in logged
            if event.get("access", {}).get("prefill_route")
        ]

    async def test_a_second_turn_at_the_other_proxy_follows_the_first(self) -> None:
        other = await self.two()
        logged = self.logged()
        heard = routes_of(other).applied()
        await self.ask(self.proxy, turn(FIRST))
        await heard  # the other proxy applied the first proxy's choice
        await self.ask(other, turn(SECOND))
        (first, why), second = self.routed(logged)
        self.assertEqual(why, "affinity")
        self.assertEqual(second, (first, "prefix"))  # by memory: alone, it would be "affinity"
        self.assertEqual(replicas_of(other).metrics.heard.labels(kind="sent")._value.get(), 1)

    async def test_a_proxy_started_again_routes_on_what_the_fleet_sent_before(self) -> None:
        other = await self.two()
        logged = self.logged()
        heard = routes_of(other).applied()
        await self.ask(self.proxy, turn(FIRST))
        await heard  # (in Redis, then)
        await self.proxy.stop()
        again = self.another()  # a new process: a new replica, its memory empty
        await routes_of(again).caught_up()
        await self.ask(again, turn(SECOND))
        (first, _), second = self.routed(logged)
        self.assertEqual(second, (first, "prefix"))

    async def test_a_kv_aware_prediction_reaches_the_other_proxy_before_any_event(self) -> None:
        self.redis = await real_redis(self)
        self.settings = {"replicas_redis": self.redis.url, "prefill_policy": "kv-aware"}
        await self.start(prefills=2, kv_events=True, kv_replay=True)
        published = [f"{f.url}#kv-events={f.kv_events_port}" for f in self.prefills]
        one, other = self.another(published), self.another(published)
        for fake in self.prefills:
            await fake.subscribed()
            await fake.subscribed()  # (both proxies)
        for each in (one, other):
            await replicas_of(each).ready()
        for fake in self.prefills:
            assert fake.kv_publisher is not None
            fake.kv_publisher.hold()  # no BlockStored reaches either proxy
        logged = self.logged()
        heard = routes_of(other).applied()
        await self.ask(one, turn([{"role": "user", "content": DOCUMENT + "\nWhat?"}]))
        await heard
        await self.ask(other, turn([{"role": "user", "content": DOCUMENT + "\nWhy?"}]))
        (first, why), second = self.routed(logged)
        self.assertEqual(why, "no_match")
        self.assertEqual(second, (first, "kv_predicted"))
        self.assertEqual(replicas_of(other).metrics.heard.labels(kind="predicted")._value.get(), 1)

    async def test_a_stored_response_is_found_from_the_other_proxy(self) -> None:
        other = await self.two(decodes=2)
        made = await self.ask(self.proxy, {"model": "m", "input": "x"}, "/v1/responses")
        again = await self.http.get(f"{other.url}/v1/responses/{made['id']}")
        self.assertEqual((again.code, json.loads(await again.content())["id"]), (200, made["id"]))
        asked = [[r.path for r in d.requests if r.role == "other"] for d in self.decodes]
        # Straight to the instance that holds it: none asked in vain.
        self.assertEqual(sorted(asked), [[], [f"/v1/responses/{made['id']}"]])

    async def test_a_stored_response_is_its_tenants_alone_from_either_proxy(self) -> None:
        keys = Path(tempfile.mkdtemp(prefix="nixlproxy-keys-"))
        self.addCleanup(shutil.rmtree, keys)
        (keys / "keys").write_text("sk-alpha alpha\nsk-low low\n")
        other = await self.two(decodes=2, api_keys_file=str(keys / "keys"))

        def headers(key: str) -> dict[bytes | str, bytes | str]:
            return {"Authorization": f"Bearer {key}"}

        made = await self.http.post(
            self.proxy.url + "/v1/responses",
            json={"model": "m", "input": "x"},
            headers=headers("sk-alpha"),
        )
        made_id = json.loads(await made.content())["id"]
        # (its share, sent on the first proxy's one connection, answered before this)
        await replicas_of(self.proxy).link.command("PING")
        for method, path in (("GET", ""), ("POST", "/cancel")):
            refused = await self.http.request(
                method,
                f"{other.url}/v1/responses/{made_id}{path}",
                headers=headers("sk-low"),
                data=b"{}" if method == "POST" else None,
            )
            answer = json.loads(await refused.content())
            self.assertEqual((refused.code, answer["error"]["code"]), (404, "not_found"))
        self.assertEqual(
            [r.path for d in self.decodes for r in d.requests if r.role == "other"], []
        )
        again = await self.http.get(
            f"{other.url}/v1/responses/{made_id}", headers=headers("sk-alpha")
        )
        self.assertEqual((again.code, json.loads(await again.content())["id"]), (200, made_id))

    async def test_with_redis_away_nothing_fails_and_each_keeps_its_own_memory(self) -> None:
        other = await self.two()
        await self.redis.stop()
        for each in (self.proxy, other):
            await replicas_of(each).beat()  # (no answer: alone)
        logged = self.logged()
        await self.ask(self.proxy, turn(FIRST))
        await self.ask(self.proxy, turn(SECOND))
        await self.ask(other, turn(SECOND))
        (first, _), second, third = self.routed(logged)
        self.assertEqual(second, (first, "prefix"))  # its own memory, as a lone proxy
        self.assertEqual(third, (first, "affinity"))  # the other never heard of it
        await self.redis.start()
        for each in (self.proxy, other):
            link = replicas_of(each).link
            if not link.open:  # (the first may be back while the other is waited for)
                await link.connected()
            await replicas_of(each).beat()
        heard = routes_of(other).applied()  # (its reader reads again within a second)
        await self.ask(self.proxy, turn([*SECOND[:1], {"role": "user", "content": "More?"}]))
        await heard
