"""Past the instances' caps: requests wait in the proxy, fairly, and are told when they cannot."""

from __future__ import annotations

from typing import Any

from nixl_twisted.backends.capacity import COOL
from nixl_twisted.config import ProxyConfig
from nixl_twisted.protocol import routes
from nixl_twisted.testing import InMemoryClient
from tests.memory.support import CHAT, Setup, assert_error


def capped(**settings: Any) -> Setup:
    """One prefill and one decode instance, one leg each at once, two may wait 5 s."""
    settings = {
        "decode_max_in_flight": 1,
        "prefill_max_in_flight": 1,
        "queue_size": 2,
        "queue_timeout": 5,
        **settings,
    }
    return Setup(**settings)


def admissions(setup: Setup) -> dict[str, float]:
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in setup.scrape().items()
        if name == "nixlproxy_admissions_total"
    }


def roles(setup: Setup) -> list[str]:
    """The legs the fakes saw, in order: which instance took which."""
    return [f"{r.role}:{r.request_id}" for fake in setup.prefills for r in fake.requests]


def test_past_the_decode_cap_a_request_waits_and_nothing_is_sent_for_it(
    access_events: list[dict[str, Any]],
) -> None:
    setup = capped()
    setup.decode.hold_answers()
    first = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    second = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    # The decode slot is taken: the second request waits, and its prefill is not sent.
    assert len(setup.prefill.requests) == 1 and len(setup.decode.requests) == 1
    (queue,) = setup.proxy.app.serving.queues()
    assert (queue["waiting"], queue["tenants"]) == (1, {"": 1})
    setup.proxy.advance(2)
    setup.decode.release()
    setup.proxy.flush()
    assert (first.answer().status, second.answer().status) == (200, 200)
    assert len(setup.prefill.requests) == 2
    assert sorted(str(e.get("queued_ms")) for e in access_events) == ["2000", "None"]
    assert admissions(setup) == {"at_once": 1.0, "after_wait": 1.0}


def test_the_decode_slot_is_held_before_prefill_is_sent_and_through_the_handoff() -> None:
    setup = capped()
    setup.prefill.hold_answers()
    setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    decode = setup.proxy.service.backends.decode.instances[0]
    prefill = setup.proxy.service.backends.prefill.instances[0]
    # In prefill: its decode instance is chosen and held already.
    assert (prefill.in_flight, decode.in_flight) == (1, 1)
    assert setup.decode.requests == []


def test_a_full_queue_and_a_wait_past_the_timeout_are_503_with_retry_after() -> None:
    setup = capped()
    setup.decode.hold_answers()
    setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    waiting = [setup.post(routes.CHAT_COMPLETIONS, CHAT) for _ in range(2)]
    setup.proxy.flush()
    full = setup.post(routes.CHAT_COMPLETIONS, CHAT).answer()
    assert_error(full, 503, "queue_full")
    assert full.values("Retry-After") == ["5"]  # nothing let go yet: the timeout
    setup.proxy.advance(5)
    for client in waiting:
        answer = client.answer()
        assert_error(answer, 503, "queue_timeout")
        assert answer.values("Retry-After") == ["5"]
    assert len(setup.prefill.requests) == 1  # none of them was sent
    assert admissions(setup) == {"at_once": 1.0, "queue_full": 1.0, "timed_out": 2.0}


def test_a_client_that_leaves_while_its_request_waits_takes_it_out() -> None:
    setup = capped()
    setup.decode.hold_answers()
    first = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    gone = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    gone.disconnect()
    setup.proxy.flush()
    assert setup.proxy.app.serving.queues() == []
    setup.decode.release()
    setup.proxy.flush()
    assert first.answer().status == 200
    assert len(setup.prefill.requests) == 1 and len(setup.decode.requests) == 1
    assert admissions(setup) == {"at_once": 1.0, "left": 1.0}


def test_the_drain_timeout_answers_every_waiting_request_at_once() -> None:
    setup = capped()
    setup.decode.hold_answers()
    first = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    waiting = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    # What ProxyService does once the drain timeout ends (tests/loopback/test_limits.py serves
    # what waits in the drain window, with a real stop).
    setup.proxy.app.admission.start_draining()
    setup.proxy.app.serving.stop_queueing()
    setup.proxy.flush()
    assert_error(waiting.answer(), 503, "draining")
    setup.decode.release()  # the one in flight drains as before
    setup.proxy.flush()
    assert first.answer().status == 200


def test_a_reload_that_raises_the_cap_lets_a_waiting_request_go() -> None:
    setup = capped()
    setup.decode.hold_answers()
    setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    waiting = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    assert len(setup.decode.requests) == 1
    config = setup.proxy.service.config
    given = {k: v for k, v in config.settings().items() if v is not None}
    more = dict(given, **{"decode-max-in-flight": 2, "prefill-max-in-flight": 2})
    setup.proxy.service.reconfigure(ProxyConfig.from_settings(more))
    setup.proxy.flush()
    assert len(setup.decode.requests) == 2  # it went at the reload
    setup.decode.release()
    setup.proxy.flush()
    assert waiting.answer().status == 200


def test_an_instances_own_cap_and_its_models_win_over_the_pools() -> None:
    setup = capped(decode_max_in_flight=5)
    decode = setup.proxy.service.backends.decode
    assert decode.instances[0].slots == 5
    decode.add(f"{setup.decode.url}-other#max-in-flight=2")
    assert [i.slots for i in decode.instances] == [5, 2]


def test_vllm_503_on_decode_is_retried_on_another_instance_which_counts_as_full() -> None:
    setup = Setup(decodes=2, decode_retries=1)
    busy, spare = setup.decodes
    busy.crash_next(503, "the engine's queue is full")
    served: list[InMemoryClient] = []
    for _ in range(2):
        served.append(setup.post(routes.CHAT_COMPLETIONS, CHAT))
    assert [c.answer().status for c in served] == [200, 200]
    assert (len(busy.requests), len(spare.requests)) == (1, 2)
    instance = setup.proxy.service.backends.decode.instances[0]
    assert instance.healthy and instance.full_until == setup.clock.seconds() + COOL
    retried = setup.scrape()[("nixlproxy_retries_total", (("pool", "decode"),))]
    assert retried == 1


def test_a_sheddable_tenant_is_refused_at_once_when_the_fleet_is_full() -> None:
    tenants = '{"batch": {"priority": -1}}'
    setup = capped(tenant_header="x-team", tenants=tenants)
    setup.decode.hold_answers()
    setup.post(routes.CHAT_COMPLETIONS, CHAT, {"x-team": "batch"})  # room: served
    setup.proxy.flush()
    shed = setup.post(routes.CHAT_COMPLETIONS, CHAT, {"x-team": "batch"}).answer()
    assert_error(shed, 503, "shed")
    assert shed.values("Retry-After")


def test_a_reload_that_changes_a_weight_applies_it_to_the_requests_that_come_after() -> None:
    setup = capped(queue_size=10, tenant_header="x-team", tenants='{"a": {}, "b": {}}')
    setup.decode.hold_answers()

    def send(name: str) -> None:
        setup.post(routes.CHAT_COMPLETIONS, CHAT, {"x-team": name[0], "x-request-id": name})
        setup.proxy.flush()

    for name in ("a0", "a1", "b1"):
        send(name)
    config = setup.proxy.service.config
    given = {k: v for k, v in config.settings().items() if v is not None}
    heavier = dict(given, tenants='{"a": {}, "b": {"weight": 4}}')
    setup.proxy.service.reconfigure(ProxyConfig.from_settings(heavier))
    for name in ("b2", "b3", "a2"):
        send(name)
    for _ in range(5):
        setup.decode.release()
        setup.decode.hold_answers()
        setup.proxy.flush()
    # a1 and b1 keep the places they were given; b's next two, at weight 4, go before a2.
    assert [r.request_id for r in setup.decode.requests] == ["a0", "a1", "b1", "b2", "b3", "a2"]


def test_a_full_queue_pushes_out_the_request_its_fair_order_lets_go_last(
    access_events: list[dict[str, Any]],
) -> None:
    tenants = '{"a": {"weight": 3}, "b": {"weight": 1}}'
    setup = capped(tenant_header="x-team", tenants=tenants)
    setup.decode.hold_answers()
    setup.post(routes.CHAT_COMPLETIONS, CHAT)  # the one decode slot
    setup.proxy.flush()
    sent = {}
    for name in ("b1", "b2", "a1"):
        sent[name] = setup.post(routes.CHAT_COMPLETIONS, CHAT, {"x-team": name[0]})
        setup.proxy.flush()
    # b2 (tag 2) would go after a1 (tag 1/3): it leaves the full queue for it.
    pushed = sent["b2"].answer()
    assert_error(pushed, 503, "queue_full")
    assert pushed.values("Retry-After") == ["5"]
    assert [e.get("ended") for e in access_events] == ["pushed_out"]
    assert admissions(setup) == {"at_once": 1.0, "pushed_out": 1.0}
    assert sent["b1"].received() == sent["a1"].received() == b""  # (both still wait)
    (queue,) = setup.proxy.app.serving.queues()
    assert (queue["waiting"], queue["tenants"]) == (2, {"a": 1, "b": 1})
    for _ in range(3):
        setup.decode.release()
        setup.decode.hold_answers()
        setup.proxy.flush()
    assert (sent["a1"].answer().status, sent["b1"].answer().status) == (200, 200)
