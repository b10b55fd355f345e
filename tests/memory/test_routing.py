"""Policies end to end: proxies before fakes whose prefix caches and /metrics are vLLM's."""

from __future__ import annotations

import json
from typing import Any

from nixl_twisted.testing import InMemoryProxy
from tests.memory.support import Setup

SYSTEM = {"role": "system", "content": "You answer questions about disaggregated serving. " * 12}


def turn(conversation: int, history: list[dict[str, str]]) -> dict[str, Any]:
    opening = [SYSTEM, {"role": "user", "content": f"Conversation {conversation}: " + "why? " * 80}]
    return {"model": "fake-model", "messages": opening + history}


def test_two_replicas_send_every_turn_of_a_conversation_to_one_prefill() -> None:
    setup = Setup(prefills=3, prefill_policy="cache-aware")
    other = InMemoryProxy(setup.prefills, setup.decodes, setup.clock)  # before the same fakes
    other.service.backends.use_policies(setup.proxy.service.config.policies)
    for conversation in range(6):
        history: list[dict[str, str]] = []
        for number in range(4):
            proxy = (setup.proxy, other)[number % 2]  # the turns alternate between replicas
            body = json.dumps(turn(conversation, history)).encode()
            answer = proxy.request(
                "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
            ).answer()
            assert answer.status == 200
            history += [
                {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"and turn {number}? " * 40},
            ]
    served = [len(p.requests_for("prefill")) for p in setup.prefills]
    assert sum(served) == 24
    # Each conversation found its history where it was: 3 of 4 turns hit.
    hits = sum(p.cache.hits for p in setup.prefills)
    queries = sum(p.cache.queries for p in setup.prefills)
    assert hits / queries > 0.6
    for fake in setup.prefills:
        firsts = {
            (r.body or {})["messages"][1]["content"][:16] for r in fake.requests_for("prefill")
        }
        # A prefill saw whole conversations: each one it saw, it saw 4 times.
        assert len(fake.requests_for("prefill")) == 4 * len(firsts)


def test_the_decision_is_in_the_access_event_and_the_metrics(
    access_events: list[dict[str, Any]],
) -> None:
    setup = Setup(prefills=2, prefill_policy="cache-aware")
    assert setup.post("/v1/chat/completions", turn(1, [])).answer().status == 200
    (event,) = access_events
    assert event["prefill_route"] == "affinity"
    assert "decode_route" not in event  # round-robin's "next" says nothing
    assert (
        'nixlproxy_routing_decisions_total{decision="affinity",policy="cache-aware",'
        'pool="prefill"} 1.0'
    ) in setup.metrics()


def test_load_reads_vllms_metrics_and_healthcheck_shows_them() -> None:
    setup = Setup(prefills=2, prefill_policy="load")
    busy = setup.prefills[0]
    busy.running = 7  # as vLLM would report a full batch of other clients' requests
    setup.settle(setup.proxy.service.checks.check_health())
    health = setup.get("/healthcheck").answer().json()
    loads = [i["load"] for i in health["instances"]["prefill"]]
    assert [load["running"] for load in loads] == [7.0, 0.0]
    for _ in range(6):
        assert setup.post("/v1/chat/completions", turn(0, [])).answer().status == 200
    assert [len(p.requests_for("prefill")) for p in setup.prefills] == [0, 6]


def test_unreadable_metrics_fall_back_and_mark_nothing_down() -> None:
    setup = Setup(prefills=2, prefill_policy="load")
    setup.prefills[0].metrics_status = 500
    setup.settle(setup.proxy.service.checks.check_health())
    first = setup.proxy.service.backends.prefill.instances[0]
    assert (first.healthy, first.load) == (True, {})
    assert setup.post("/v1/chat/completions", turn(0, [])).answer().status == 200
