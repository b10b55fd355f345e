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


def waits(setup: Setup) -> tuple[int, int]:
    """(waiting for their first slot, prefilled and ready for decode), over every model."""
    queues = setup.proxy.app.serving.queues()
    return sum(q["waiting"] for q in queues), sum(q["ready"] for q in queues)


def test_past_the_decode_cap_prefill_runs_one_ahead_and_the_next_waits_unsent(
    access_events: list[dict[str, Any]],
) -> None:
    setup = capped(queue_size=3)
    setup.decode.hold_answers()
    clients = []
    for _ in range(3):
        clients.append(setup.post(routes.CHAT_COMPLETIONS, CHAT))
        setup.proxy.flush()
    # The first holds the decode slot; the second is prefilled (one ahead per decode slot)
    # and waits ready for decode; the third waits for its prefill, nothing sent for it.
    assert len(setup.prefill.requests) == 2 and len(setup.decode.requests) == 1
    (queue,) = setup.proxy.app.serving.queues()
    assert (queue["waiting"], queue["ready"], queue["tenants"]) == (1, 1, {"": 2})
    assert (queue["ahead"], queue["ahead_limit"]) == (1, 1)
    setup.proxy.advance(2)
    setup.decode.release()
    setup.proxy.flush()
    assert [c.answer().status for c in clients] == [200, 200, 200]
    assert len(setup.prefill.requests) == 3
    assert sorted(str(e.get("queued_ms")) for e in access_events) == ["2000", "None", "None"]
    assert sorted(str(e.get("ready_wait_ms")) for e in access_events) == ["2000", "None", "None"]
    left = sorted(int(e["kv_lease_left_ms"]) for e in access_events)
    assert left == [28000, 30000, 30000]  # (the second's lease ran 2 s while it waited)
    assert admissions(setup) == {
        "at_once": 2.0,
        "after_wait": 1.0,
        "ready_at_once": 2.0,
        "ready_after_wait": 1.0,
    }


def test_the_decode_slot_is_not_held_while_prefill_runs_and_is_taken_at_the_handoff() -> None:
    setup = capped()
    setup.prefill.hold_answers()
    setup.decode.hold_answers()
    setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    decode = setup.proxy.service.backends.decode.instances[0]
    prefill = setup.proxy.service.backends.prefill.instances[0]
    # In prefill: no decode slot is held yet (before, it was chosen and held already).
    assert (prefill.in_flight, decode.in_flight) == (1, 0)
    setup.prefill.release()
    setup.proxy.flush()
    assert (prefill.in_flight, decode.in_flight) == (0, 1)
    assert len(setup.decode.requests) == 1


def test_a_decode_only_request_takes_its_decode_slot_in_one_step_as_before() -> None:
    setup = capped(decode_only_below=1000)
    setup.decode.hold_answers()
    first = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    second = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    # Decided decode alone: no prefill, and the second waits for the decode slot.
    assert (len(setup.prefill.requests), len(setup.decode.requests)) == (0, 1)
    assert waits(setup) == (1, 0)
    setup.decode.release()
    setup.proxy.flush()
    assert (first.answer().status, second.answer().status) == (200, 200)
    assert admissions(setup) == {"at_once": 1.0, "after_wait": 1.0}


def test_prefill_runs_no_further_ahead_than_the_decode_caps() -> None:
    setup = capped(decode_max_in_flight=2, prefill_max_in_flight=8, queue_size=10)
    setup.decode.hold_answers()
    clients = [setup.post(routes.CHAT_COMPLETIONS, CHAT) for _ in range(6)]
    setup.proxy.flush()
    # Two decoding, two prefilled and ready (one per decode slot), two waiting unsent,
    # though prefill has room for all.
    assert (len(setup.decode.requests), len(setup.prefill.requests)) == (2, 4)
    assert waits(setup) == (2, 2)
    gauge = setup.scrape()
    assert gauge[("nixlproxy_prefill_ahead", (("model", ""),))] == 2
    assert gauge[("nixlproxy_prefill_ahead_limit", (("model", ""),))] == 2
    setup.decode.release()
    setup.proxy.flush()
    assert [c.answer().status for c in clients] == [200] * 6


def test_prefill_run_ahead_sets_the_limit() -> None:
    setup = capped(decode_max_in_flight=2, prefill_max_in_flight=8, prefill_run_ahead=3)
    setup.decode.hold_answers()
    clients = [setup.post(routes.CHAT_COMPLETIONS, CHAT) for _ in range(6)]
    setup.proxy.flush()
    assert (len(setup.decode.requests), len(setup.prefill.requests)) == (2, 5)
    assert waits(setup) == (1, 3)
    setup.decode.release()
    setup.proxy.flush()
    assert [c.answer().status for c in clients] == [200] * 6


def test_a_full_queue_and_a_wait_past_the_timeout_are_503_but_never_for_a_ready_one() -> None:
    setup = capped()
    setup.decode.hold_answers()
    setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    ready = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    waiting = [setup.post(routes.CHAT_COMPLETIONS, CHAT) for _ in range(2)]
    setup.proxy.flush()
    # The ready one takes no room: two wait for prefill, and the queue (2) is full.
    assert waits(setup) == (2, 1)
    full = setup.post(routes.CHAT_COMPLETIONS, CHAT).answer()
    assert_error(full, 503, "queue_full")
    assert full.values("Retry-After") == ["1"]  # (two went at once: the queue drains fast)
    setup.proxy.advance(5)
    for client in waiting:
        answer = client.answer()
        assert_error(answer, 503, "queue_timeout")
    assert waits(setup) == (0, 1)  # the ready one waits on, past the queue's timeout
    assert len(setup.prefill.requests) == 2  # none of the others was sent
    setup.decode.release()
    setup.proxy.flush()
    assert ready.answer().status == 200
    assert admissions(setup) == {
        "at_once": 2.0,
        "queue_full": 1.0,
        "timed_out": 2.0,
        "ready_at_once": 1.0,
        "ready_after_wait": 1.0,
    }


def test_a_client_that_leaves_while_its_request_waits_takes_it_out() -> None:
    setup = capped()
    setup.decode.hold_answers()
    first = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    ready = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    gone = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    gone.disconnect()
    setup.proxy.flush()
    assert waits(setup) == (0, 1)
    # A ready request whose client leaves is taken out too: no decode leg is sent for it
    # (its KV on prefill is left to vLLM's lease).
    ready.disconnect()
    setup.proxy.flush()
    assert setup.proxy.app.serving.queues() == []
    setup.decode.release()
    setup.proxy.flush()
    assert first.answer().status == 200
    assert len(setup.prefill.requests) == 2 and len(setup.decode.requests) == 1
    assert admissions(setup) == {"at_once": 2.0, "left": 2.0, "ready_at_once": 1.0}


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
    clients = []
    for _ in range(2):  # room: one served, one prefilled ahead (a ready one is never shed)
        clients.append(setup.post(routes.CHAT_COMPLETIONS, CHAT, {"x-team": "batch"}))
        setup.proxy.flush()
    assert waits(setup) == (0, 1)
    shed = setup.post(routes.CHAT_COMPLETIONS, CHAT, {"x-team": "batch"}).answer()
    assert_error(shed, 503, "shed")
    assert shed.values("Retry-After")
    setup.decode.release()
    setup.proxy.flush()
    assert [c.answer().status for c in clients] == [200, 200]


def test_a_reload_that_changes_a_weight_applies_it_to_the_requests_that_come_after() -> None:
    setup = capped(queue_size=10, tenant_header="x-team", tenants='{"a": {}, "b": {}}')
    setup.decode.hold_answers()

    def send(name: str) -> None:
        setup.post(routes.CHAT_COMPLETIONS, CHAT, {"x-team": name[0], "x-request-id": name})
        setup.proxy.flush()

    for name in ("a0", "a1", "a2", "b1"):  # (a0 decodes, a1 is prefilled ahead: both went)
        send(name)
    config = setup.proxy.service.config
    given = {k: v for k, v in config.settings().items() if v is not None}
    heavier = dict(given, tenants='{"a": {}, "b": {"weight": 4}}')
    setup.proxy.service.reconfigure(ProxyConfig.from_settings(heavier))
    for name in ("b2", "b3", "a3"):
        send(name)
    for _ in range(6):
        setup.decode.release()
        setup.decode.hold_answers()
        setup.proxy.flush()
    # a2 and b1 keep the places they were given; b's next two, at weight 4, go before a3.
    order = ["a0", "a1", "a2", "b1", "b2", "b3", "a3"]
    assert [r.request_id for r in setup.decode.requests] == order


def test_a_ready_request_near_its_kv_lease_end_is_sent_to_decode_over_its_cap(
    access_events: list[dict[str, Any]],
) -> None:
    setup = capped(kv_lease_duration=3)  # (the guard at 2 s: a third of a short lease kept)
    setup.decode.hold_answers()
    first = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    ready = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    assert (len(setup.decode.requests), waits(setup)) == (1, (0, 1))
    setup.proxy.advance(1.9)
    assert len(setup.decode.requests) == 1
    setup.proxy.advance(0.1)
    # Over the decode cap of 1: inside vLLM's queue its lease is renewed.
    assert len(setup.decode.requests) == 2 and waits(setup) == (0, 0)
    assert setup.proxy.service.backends.decode.instances[0].in_flight == 2
    assert setup.scrape()[("nixlproxy_lease_guard_total", ())] == 1
    setup.decode.release()
    setup.proxy.flush()
    assert first.answer().status == ready.answer().status == 200
    guarded = [e for e in access_events if e.get("ready_wait_ms")]
    assert [(e["ready_wait_ms"], e["kv_lease_left_ms"]) for e in guarded] == [(2000, 1000)]


def test_a_full_queue_pushes_out_the_request_its_fair_order_lets_go_last(
    access_events: list[dict[str, Any]],
) -> None:
    tenants = '{"a": {"weight": 3}, "b": {"weight": 1}}'
    setup = capped(tenant_header="x-team", tenants=tenants)
    setup.decode.hold_answers()
    setup.post(routes.CHAT_COMPLETIONS, CHAT)  # the one decode slot
    setup.proxy.flush()
    setup.post(routes.CHAT_COMPLETIONS, CHAT)  # prefilled, ready: it takes no room
    setup.proxy.flush()
    sent = {}
    for name in ("b1", "b2", "a1"):
        sent[name] = setup.post(routes.CHAT_COMPLETIONS, CHAT, {"x-team": name[0]})
        setup.proxy.flush()
    # b2 (tag 2) would go after a1 (tag 1/3): it leaves the full queue for it.
    pushed = sent["b2"].answer()
    assert_error(pushed, 503, "queue_full")
    assert pushed.values("Retry-After") == ["1"]  # (two let go at once: it drains fast)
    assert [e.get("ended") for e in access_events] == ["pushed_out"]
    assert admissions(setup) == {"at_once": 2.0, "ready_at_once": 1.0, "pushed_out": 1.0}
    assert sent["b1"].received() == sent["a1"].received() == b""  # (both still wait)
    (queue,) = setup.proxy.app.serving.queues()
    assert (queue["waiting"], queue["ready"]) == (2, 1)
    assert queue["tenants"] == {"": 1, "a": 1, "b": 1}
    for _ in range(4):
        setup.decode.release()
        setup.decode.hold_answers()
        setup.proxy.flush()
    assert (sent["a1"].answer().status, sent["b1"].answer().status) == (200, 200)
