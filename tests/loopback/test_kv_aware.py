"""kv-aware over real ZeroMQ and HTTP: fakes publish their KV events, the proxy routes on them.

Each fake's publisher tells when the proxy's subscription has arrived
(``subscribed``) and the proxy tells when it has taken a batch in
(``KvEvents.read``), so nothing here waits on the wall clock.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import ensureDeferred, gatherResults
from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from nixl_twisted.testing import FakeVLLM
from tests.support import ProxyCase

DOCUMENT = "A long shared document about prefill, decode and KV blocks. " * 40


def chat(question: str) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": f"{DOCUMENT}\n{question}"}],
        "max_tokens": 2,
    }


class KvAwareTests(ProxyCase):
    timeout = 15

    async def start_kv(self, replay: bool = True, prefills: int = 2, **proxy: object) -> None:
        await self.start(
            prefills=prefills,
            proxy={"prefill_policy": "kv-aware", "health_interval": 0, **proxy},
            kv_events=True,
            kv_replay=replay,
        )
        await self.proxy.stop()
        # The fakes' URLs again, each with where it publishes.
        urls = [self.published(fake, replay) for fake in self.prefills]
        self.proxy = self.start_proxy(
            urls,
            [f.url for f in self.decodes],
            prefill_policy="kv-aware",
            health_interval=0,
            **proxy,  # type: ignore[arg-type]
        )
        self.events = self.proxy.service.app.serving.legs.kv
        for fake in self.prefills:
            await fake.subscribed()

    def published(self, fake: FakeVLLM, replay: bool) -> str:
        url = f"{fake.url}#kv-events={fake.kv_events_port}"
        return url + (f"&kv-replay={fake.kv_replay_port}" if replay else "")

    async def ask(self, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.http.post(
            self.proxy.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers=Headers({b"Content-Type": [b"application/json"]}),
        )
        answer = json.loads(await response.content())
        self.assertEqual(response.code, 200, answer)
        return answer

    def prefilled(self) -> list[int]:
        return [len(fake.requests_for("prefill")) for fake in self.prefills]

    def routes(self, logged: list[dict[str, Any]]) -> list[tuple[str, int | None]]:
        found = []
        for event in logged:
            access = event.get("access")
            if access and access.get("path") == "/v1/chat/completions":
                found.append((access.get("prefill_route"), access.get("prefill_matched_tokens")))
        return found

    async def test_a_prompt_goes_to_the_instance_whose_events_say_it_holds_its_prefix(
        self,
    ) -> None:
        await self.start_kv()
        logged = self.logged()
        first = self.prefilled()
        reading = [self.events.read("prefill", self.proxy_url(f)) for f in self.prefills]
        await self.ask(chat("What is it about?"))
        home = next(i for i, n in enumerate(self.prefilled()) if n > first[i])
        await reading[home]  # its BlockStored taken in
        blocks = self.events.index("prefill").blocks(self.proxy_url(self.prefills[home]))
        self.assertGreater(blocks, 0)
        for question in ("Why?", "Who uses it?", "How fast is it?"):
            await self.ask(chat(question))
        self.assertEqual(self.prefilled()[home], 4)
        routes = self.routes(logged)
        self.assertEqual(routes[0], ("no_match", 0))
        for decision, held in routes[1:]:
            self.assertEqual(decision, "kv_match")
            self.assertGreaterEqual(held or 0, 128)  # at least one whole block of 128
        # What vLLM's own counters say: every later prompt hit the blocks where routed.
        self.assertGreater(self.prefills[home].cache.hits, 0)

    def proxy_url(self, fake: FakeVLLM) -> str:
        return fake.url

    async def test_instances_given_without_their_ports_are_asked_where_they_publish(
        self,
    ) -> None:
        """GET /kv_event_sources on each fake: ``tcp://*:PORT`` on its own host, then routed on."""
        await self.start(
            prefills=2,
            proxy={"prefill_policy": "kv-aware", "health_interval": 0},
            kv_events=True,
            kv_replay=True,
        )
        self.events = self.proxy.service.app.serving.legs.kv
        for fake in self.prefills:
            await fake.subscribed()  # asked, answered, subscribed
            self.assertEqual(fake.kv_sources_reads, 1)
            said = await self.health_of(fake)
            assert fake.kv_events_port is not None and fake.kv_replay_port is not None
            self.assertEqual(said["endpoint"], f"tcp://127.0.0.1:{fake.kv_events_port}")
            self.assertEqual(said["replay"], f"tcp://127.0.0.1:{fake.kv_replay_port}")
            self.assertEqual(
                (said["found"], said["asked"], said["reason"]), ("asked", "found", None)
            )
        logged = self.logged()
        first = self.prefilled()
        reading = [self.events.read("prefill", f.url) for f in self.prefills]
        await self.ask(chat("What is it about?"))
        home = next(i for i, n in enumerate(self.prefilled()) if n > first[i])
        await reading[home]
        for question in ("Why?", "Who uses it?"):
            await self.ask(chat(question))
        self.assertEqual(self.prefilled()[home], 3)
        self.assertEqual([r[0] for r in self.routes(logged)], ["no_match", "kv_match", "kv_match"])
        self.assertEqual([f.kv_sources_reads for f in self.prefills], [1, 1])  # asked no more

    async def test_salted_blocks_draw_prompts_of_their_salt_only(self) -> None:
        """The fakes hash ``cache_salt`` into a prompt's first block and publish it as vLLM does."""
        await self.start_kv()
        logged = self.logged()
        first = self.prefilled()
        reading = [self.events.read("prefill", self.proxy_url(f)) for f in self.prefills]
        await self.ask(dict(chat("What is it about?"), cache_salt="tenant-a"))
        home = next(i for i, n in enumerate(self.prefilled()) if n > first[i])
        await reading[home]  # its BlockStored, salted, taken in
        await self.ask(dict(chat("Why?"), cache_salt="tenant-a"))
        await self.ask(dict(chat("Why?"), cache_salt="tenant-b"))
        await self.ask(chat("Why?"))
        routes = self.routes(logged)
        self.assertEqual(routes[1][0], "kv_match")
        self.assertGreaterEqual(routes[1][1] or 0, 128)
        self.assertEqual(routes[2:], [("no_match", 0), ("no_match", 0)])
        sent = [r.body for r in self.prefills[home].requests_for("prefill")]
        self.assertEqual([(body or {}).get("cache_salt") for body in sent[:2]], ["tenant-a"] * 2)
        self.assertGreaterEqual(self.prefills[home].cache.hits, 128)  # the second, under its salt

    async def test_blocks_hashed_with_lookahead_tokens_draw_the_prompts_that_follow(
        self,
    ) -> None:
        """The fakes hash each block with the 3 tokens after it and publish them, as vLLM 0.34
        does under EAGLE: the proxy learns it from the events and its keys still meet."""
        await self.start_kv()
        for fake in self.prefills:
            fake.cache.lookahead = 3  # (FakeVLLM has no field for it: its cache's option)
        logged = self.logged()
        first = self.prefilled()
        reading = [self.events.read("prefill", self.proxy_url(f)) for f in self.prefills]
        await self.ask(chat("What is it about?"))
        home = next(i for i, n in enumerate(self.prefilled()) if n > first[i])
        await reading[home]  # its BlockStored, with lookahead_token_ids, taken in
        index = self.events.index("prefill")
        self.assertEqual(index.lookahead(self.proxy_url(self.prefills[home])), 3)
        for question in ("Why?", "Who uses it?"):
            await self.ask(chat(question))
        self.assertEqual(self.prefilled()[home], 3)
        routes = self.routes(logged)
        self.assertEqual([r[0] for r in routes], ["no_match", "kv_match", "kv_match"])
        self.assertGreaterEqual(routes[1][1] or 0, 128)
        self.assertGreaterEqual(self.prefills[home].cache.hits, 2 * (routes[1][1] or 0))

    async def test_two_requests_sharing_a_new_prefix_that_arrive_together_go_to_one_instance(
        self,
    ) -> None:
        """vLLM reports blocks once its step has run: until then, the choice itself counts."""
        await self.start_kv(prefills=4)
        await self.computed(self.prefills[0], 1000, 128)  # the pool's block size said: 128
        for fake in self.prefills:
            assert fake.kv_publisher is not None
            fake.kv_publisher.hold()  # no step has run yet: nothing reported
        logged = self.logged()
        await gatherResults(
            [ensureDeferred(self.ask(chat(q))) for q in ("What is it about?", "Who wrote it?")]
        )
        (home,) = [fake for fake in self.prefills if fake.requests_for("prefill")]  # one
        self.assertEqual(len(home.requests_for("prefill")), 2)
        # (in the order they ended: either may end first)
        self.assertEqual(sorted(self.routes(logged)), [("kv_predicted", 512), ("no_match", 0)])
        said = await self.health_of(home)
        held = said["blocks"]  # (the block stored first, if it was there)
        self.assertEqual((said["predicted"], said["predictions"]), (4, {}))
        reading = self.events.read("prefill", home.url)
        assert home.kv_publisher is not None
        home.kv_publisher.release()  # the step's BlockStored confirms what was predicted
        await reading
        said = await self.health_of(home)
        self.assertEqual((said["blocks"], said["predicted"]), (held + 4, 0))
        self.assertEqual(said["predictions"], {"confirmed": 4})
        self.assertEqual(await self.kv_predictions_counted(home, "confirmed"), 4.0)

    async def kv_predictions_counted(self, fake: FakeVLLM, outcome: str) -> float:
        response = await self.http.get(self.proxy.url + "/metrics")
        text = (await response.content()).decode()
        line = (
            f'nixlproxy_kv_predictions_total{{instance="{fake.url}",'
            f'outcome="{outcome}",pool="prefill"}}'
        )
        found = [float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)]
        return found[0] if found else 0.0

    async def computed(self, fake: FakeVLLM, first: int, count: int) -> None:
        """Tokens ``first`` on computed on ``fake``, once the proxy has read the batch."""
        reading = self.events.read("prefill", fake.url)
        fake.cache.compute(list(range(first, first + count)))
        await reading

    async def test_a_gap_is_replayed_and_the_index_stays_whole(self) -> None:
        await self.start_kv()
        target = self.prefills[0]
        url = self.proxy_url(target)
        publisher = target.kv_publisher
        assert publisher is not None
        await self.computed(target, 1000, 256)  # 2 blocks, seq 0
        publisher.skip(1)  # seq 1 is kept for replay but never sent
        target.cache.compute(list(range(2000, 2128)))
        await self.computed(target, 3000, 128)  # seq 2: the gap is seen
        self.assertTrue(self.events.stale("prefill", url))  # while the replay is out
        await self.events.read("prefill", url)  # the replay's end
        index = self.events.index("prefill")
        self.assertEqual(
            [index.matched(list(range(n, n + 128)), [url]).get(url, 0) for n in (2000, 3000)],
            [128, 128],
        )
        self.assertFalse(self.events.stale("prefill", url))
        self.assertEqual(publisher.replays, 1)

    async def test_without_replay_a_gap_clears_the_instance_and_it_routes_as_cache_aware(
        self,
    ) -> None:
        await self.start_kv(replay=False)
        target = self.prefills[0]
        url = self.proxy_url(target)
        publisher = target.kv_publisher
        assert publisher is not None
        await self.computed(target, 1000, 256)
        publisher.skip(1, keep=False)
        target.cache.compute(list(range(2000, 2128)))
        await self.computed(target, 3000, 128)
        self.assertTrue(self.events.stale("prefill", url))
        index = self.events.index("prefill")
        self.assertEqual(index.matched(list(range(1000, 1256)), [url]), {})
        logged = self.logged()
        await self.ask(chat("And now?"))
        self.assertEqual(self.routes(logged)[0][0], "fallback_stale")

    async def test_a_restarted_publisher_clears_what_the_instance_held(self) -> None:
        await self.start_kv()
        target = self.prefills[0]
        url = self.proxy_url(target)
        await self.computed(target, 1000, 256)
        target.restart_engine()
        await self.computed(target, 5000, 128)  # seq 0 again
        index = self.events.index("prefill")
        self.assertEqual(index.matched(list(range(1000, 1256)), [url]), {})
        self.assertEqual(index.matched(list(range(5000, 5128)), [url]), {url: 128})

    async def test_an_instance_that_leaves_loses_its_stream_and_its_entries(self) -> None:
        await self.start_kv()
        target = self.prefills[0]
        url = self.proxy_url(target)
        await self.computed(target, 1000, 256)
        self.proxy.service.backends.prefill.remove(url)
        self.events.reconcile()
        self.assertIsNone(self.events.status("prefill", url))
        self.assertEqual(self.events.index("prefill").blocks(url), 0)

    async def test_a_render_that_fails_routes_as_cache_aware_and_the_request_is_served(
        self,
    ) -> None:
        await self.start_kv()
        for fake in self.prefills:
            fake.render_status = 403  # vllm serve without --enable-scale-out
        logged = self.logged()
        await self.ask(chat("Still served?"))
        self.assertEqual(self.routes(logged)[0][0], "fallback_render")
        warned = [e for e in logged if "cannot render" in str(e.get("log_format", ""))]
        self.assertEqual(len(warned), 1)

    async def health_of(self, fake: FakeVLLM) -> dict[str, Any]:
        """What /healthcheck says of ``fake``'s KV events."""
        response = await self.http.get(self.proxy.url + "/healthcheck")
        said = json.loads(await response.content())
        (instance,) = [i for i in said["instances"]["prefill"] if i["url"] == fake.url]
        return dict(instance["kv_events"])

    async def kv_events_counted(self, fake: FakeVLLM, kind: str) -> float:
        response = await self.http.get(self.proxy.url + "/metrics")
        text = (await response.content()).decode()
        line = f'nixlproxy_kv_events_total{{instance="{fake.url}",kind="{kind}",pool="prefill"}}'
        found = [float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)]
        return found[0] if found else 0.0

    async def test_a_malformed_batch_is_counted_and_skipped_and_the_index_follows_on(
        self,
    ) -> None:
        await self.start_kv()
        target = self.prefills[0]
        publisher = target.kv_publisher
        assert publisher is not None
        await self.computed(target, 1000, 256)
        reading = self.events.read("prefill", target.url)
        bad = {
            "type": "BlockStored",
            "block_hashes": [12345],
            "parent_block_hash": None,
            "token_ids": ["one", None, *range(126)],  # what escaped the reader before
            "block_size": 128,
            "medium": "GPU",
        }
        publisher.publish([bad])
        await reading
        index = self.events.index("prefill")
        for first in range(2000, 2000 + 128 * 40, 128):  # later batches: each one followed
            await self.computed(target, first, 128)
            self.assertEqual(
                index.matched(list(range(first, first + 128)), [target.url]), {target.url: 128}
            )
        health = await self.health_of(target)
        self.assertEqual(health["bad_messages"], 1)
        self.assertEqual(health["last_bad"], "token_ids holds 'one', not a token id")
        self.assertEqual((health["state"], health["sequence"]), ("stale", 41))  # cleared at 1
        self.assertEqual(await self.kv_events_counted(target, "bad"), 1.0)
        self.assertEqual(index.matched(list(range(1000, 1256)), [target.url]), {})
        self.clock.advance(60)  # rebuilt from the stores since
        self.assertEqual((await self.health_of(target))["state"], "live")

    async def test_a_message_over_the_cap_is_dropped_by_zeromq_and_the_stream_comes_back(
        self,
    ) -> None:
        await self.start_kv(replay=False)
        target = self.prefills[0]
        publisher = target.kv_publisher
        assert publisher is not None
        await self.computed(target, 1000, 128)
        huge = {
            "type": "BlockStored",
            "block_hashes": list(range(1, 8193)),
            "parent_block_hash": None,
            "token_ids": list(range(70_000, 70_000 + 128 * 8192)),  # 5 bytes each: 5 MiB
            "block_size": 128,
        }
        publisher.publish([huge])
        # ZeroMQ refuses it, and drops the connection; the proxy makes it again.
        await target.subscribed()
        await self.computed(target, 3000, 128)  # a gap (seq 1 never read): cleared, stale
        index = self.events.index("prefill")
        self.assertEqual(index.matched(list(range(3000, 3128)), [target.url]), {target.url: 128})
        self.assertEqual(index.matched(list(range(1000, 1128)), [target.url]), {})
        health = await self.health_of(target)
        self.assertEqual((health["bad_messages"], health["dropped"]), (0, 1))  # never decoded
        self.assertEqual((health["state"], health["sequence"]), ("stale", 2))
        self.assertEqual(await self.kv_events_counted(target, "dropped"), 1.0)
        await self.computed(target, 4000, 128)
        self.assertEqual(index.matched(list(range(4000, 4128)), [target.url]), {target.url: 128})

    async def test_a_stream_whose_socket_closed_is_made_anew(self) -> None:
        await self.start_kv()
        target = self.prefills[0]
        stream = self.events.stream("prefill", target.url)
        assert stream is not None
        stream.subscriber.connectionLost(Failure(ConnectionDone()))  # as a reactor may
        self.events.reconcile()  # (once a second)
        self.assertIsNot(self.events.stream("prefill", target.url), stream)
        await target.subscribed()
        await self.computed(target, 1000, 128)
        index = self.events.index("prefill")
        self.assertEqual(index.matched(list(range(1000, 1128)), [target.url]), {target.url: 128})
