"""``--warm-up`` through the whole proxy: a prefill instance the admin API adds takes the misses."""

from __future__ import annotations

from typing import Any

from tests.memory.support import Setup
from tests.memory.test_admin import TOKEN, admin


def _chat(n: int) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": f"new topic {n}"}]}


def test_an_added_prefill_instance_takes_new_conversations_while_the_others_are_busy() -> None:
    setup = Setup(prefills=2, prefill_policy="cache-aware", admin_token=TOKEN)
    pool = setup.proxy.service.backends.prefill
    assert pool.warm_up == 60.0  # (the default, from the settings)
    for fake in setup.prefills:
        fake.hold_answers()
    held = [setup.post("/v1/chat/completions", _chat(n)) for n in range(4)]
    assert sum(i.in_flight for i in pool.instances) == 4
    fresh = setup.new_fake("prefill-new")
    code, _ = admin(setup, "POST", "/admin/backends", {"pool": "prefill", "url": fresh.url})
    assert code == 201
    # Its first check put it in rotation: the next new conversation goes to it.
    answer = setup.post("/v1/chat/completions", _chat(100)).answer()
    assert answer.status == 200
    assert len(fresh.requests_for("prefill")) == 1
    for fake in setup.prefills:
        fake.release()
    setup.proxy.flush()
    assert [client.answer().status for client in held] == [200] * 4
    decisions = [
        value
        for (name, labels), value in setup.scrape().items()
        if name == "nixlproxy_routing_decisions_total" and ("decision", "warm_up") in labels
    ]
    assert decisions == [1.0]


def test_the_setting_turns_it_off() -> None:
    setup = Setup(prefills=2, prefill_policy="cache-aware", warm_up=0)
    assert setup.proxy.service.backends.prefill.warm_up == 0.0
