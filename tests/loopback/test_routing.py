"""Policies end to end: real proxies before fakes whose prefix caches and /metrics are vLLM's."""

from __future__ import annotations

import json
from typing import Any

from tests.support import ProxyCase

SYSTEM = {"role": "system", "content": "You answer questions about disaggregated serving. " * 12}


def turn(conversation: int, history: list[dict[str, str]]) -> dict[str, Any]:
    opening = [SYSTEM, {"role": "user", "content": f"Conversation {conversation}: " + "why? " * 80}]
    return {"model": "m", "messages": opening + history}


class CacheAwareTests(ProxyCase):
    async def test_two_replicas_send_every_turn_of_a_conversation_to_one_prefill(self) -> None:
        await self.start(prefills=3, proxy=dict(prefill_policy="cache-aware"))
        other = self.start_proxy_on("tcp:0:interface=127.0.0.1")
        other.service.backends.use_policies(self.proxy.service.config.policies)
        for conversation in range(6):
            history: list[dict[str, str]] = []
            for number in range(4):
                proxy = (self.proxy, other)[number % 2]  # the turns alternate between replicas
                response = await self.http.post(
                    proxy.url + "/v1/chat/completions", json=turn(conversation, history)
                )
                self.assertEqual(response.code, 200)
                answer = json.loads(await response.content())
                history += [
                    {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"and turn {number}? " * 40},
                ]
        served = [len(p.requests_for("prefill")) for p in self.prefills]
        self.assertEqual(sum(served), 24)
        # Each conversation found its history where it was: 3 of 4 turns hit.
        hits = sum(p.cache.hits for p in self.prefills)
        queries = sum(p.cache.queries for p in self.prefills)
        self.assertGreater(hits / queries, 0.6)
        for fake in self.prefills:
            firsts = {
                (r.body or {})["messages"][1]["content"][:16] for r in fake.requests_for("prefill")
            }
            # A prefill saw whole conversations: each one it saw, it saw 4 times.
            self.assertEqual(len(fake.requests_for("prefill")), 4 * len(firsts))

    async def test_the_decision_is_in_the_access_event_and_the_metrics(self) -> None:
        events = self.access_events()
        await self.start(prefills=2, proxy=dict(prefill_policy="cache-aware"))
        response, _ = await self.post_json("/v1/chat/completions", turn(1, []))
        self.assertEqual(response.code, 200)
        (event,) = events
        self.assertEqual(event["prefill_route"], "affinity")
        self.assertNotIn("decode_route", event)  # round-robin's "next" says nothing
        metrics = await (await self.http.get(self.proxy.url + "/metrics")).text()
        self.assertIn(
            'nixlproxy_routing_decisions_total{decision="affinity",policy="cache-aware",'
            'pool="prefill"} 1.0',
            metrics,
        )


class LoadTests(ProxyCase):
    async def test_load_reads_vllms_metrics_and_healthcheck_shows_them(self) -> None:
        await self.start(prefills=2, proxy=dict(prefill_policy="load"))
        busy = self.prefills[0]
        busy.running = 7  # as vLLM would report a full batch of other clients' requests
        await self.proxy.service.backends.check_health()
        health = json.loads(await (await self.http.get(self.proxy.url + "/healthcheck")).text())
        loads = [i["load"] for i in health["instances"]["prefill"]]
        self.assertEqual([load["running"] for load in loads], [7.0, 0.0])
        for _ in range(6):
            response, _ = await self.post_json("/v1/chat/completions", turn(0, []))
            self.assertEqual(response.code, 200)
        self.assertEqual([len(p.requests_for("prefill")) for p in self.prefills], [0, 6])

    async def test_unreadable_metrics_fall_back_and_mark_nothing_down(self) -> None:
        await self.start(prefills=2, proxy=dict(prefill_policy="load"))
        self.prefills[0].metrics_status = 500
        await self.proxy.service.backends.check_health()
        first = self.proxy.service.backends.prefill.instances[0]
        self.assertEqual((first.healthy, first.load), (True, {}))
        response, _ = await self.post_json("/v1/chat/completions", turn(0, []))
        self.assertEqual(response.code, 200)
