"""First-token targets measured: the access event and the outcomes metric, by a Clock."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from nixl_twisted.observe import access
from nixl_twisted.web import intake
from tests.memory.support import CHAT, Setup, assert_error


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> Setup:
    """A proxy whose arrival and first byte are read on its Clock."""
    made = Setup(tenant_header="x-team", tenants={"gold": {"ttft-slo-ms": 300, "class": "gold"}})
    now = SimpleNamespace(monotonic=made.clock.seconds)
    monkeypatch.setattr(intake, "time", now)
    monkeypatch.setattr(access, "time", now)
    return made


def answered_after(setup: Setup, seconds: float, headers: dict[str, str]) -> int:
    """A chat whose decode answers ``seconds`` after it arrived: its status."""
    setup.decode.hold_answers()
    client = setup.post("/v1/chat/completions", CHAT, headers)
    setup.clock.advance(seconds)
    setup.decode.release()
    setup.proxy.flush()
    return client.answer().status


def test_a_target_is_met_or_missed_by_the_first_byte_from_arrival(
    setup: Setup, access_events: list[dict[str, Any]]
) -> None:
    assert answered_after(setup, 0.5, {"x-slo-ttft-ms": "600"}) == 200
    assert answered_after(setup, 0.5, {"x-llm-d-slo-ttft-ms": "400"}) == 200
    assert answered_after(setup, 0.2, {"x-team": "gold"}) == 200  # its tenant's 300 ms
    assert answered_after(setup, 0.4, {"x-team": "gold"}) == 200
    assert answered_after(setup, 0.4, {"x-team": "gold", "x-dynamo-meta-slo-ttft-ms": "900"}) == 200
    assert answered_after(setup, 0.5, {}) == 200  # no target: nothing said, nothing counted

    said = [
        (e.get("ttft_target_ms"), e.get("ttft_target_from"), e.get("ttft_outcome"))
        for e in access_events
    ]
    assert said == [
        (600, "x-slo-ttft-ms", "on_time"),
        (400, "x-llm-d-slo-ttft-ms", "late"),
        (300, "tenant", "on_time"),
        (300, "tenant", "late"),
        (900, "x-dynamo-meta-slo-ttft-ms", "on_time"),
        (None, None, None),
    ]
    assert "ttft=late (400ms x-llm-d-slo-ttft-ms)" in access.access_line(access_events[1])
    m = setup.scrape()

    def outcomes(tenant_class: str, outcome: str) -> float:
        labels = (("outcome", outcome), ("tenant_class", tenant_class))
        return m.get(("nixlproxy_ttft_outcomes_total", labels), 0.0)

    assert (outcomes("default", "on_time"), outcomes("default", "late")) == (1, 1)
    assert (outcomes("gold", "on_time"), outcomes("gold", "late")) == (2, 1)
    labels = {v for key in m if key[0] == "nixlproxy_ttft_outcomes_total" for _, v in key[1]}
    assert labels <= {"default", "gold", "on_time", "late"}  # never a tenant's name


def test_a_request_refused_or_failed_before_a_first_token_says_so(
    setup: Setup, access_events: list[dict[str, Any]]
) -> None:
    target = {"x-slo-ttft-ms": "1000"}
    assert setup.post("/v1/chat/completions", b"{", target).answer().status == 400
    setup.prefill.crash_next(500)
    assert setup.post("/v1/chat/completions", CHAT, target).answer().status >= 500
    bad = setup.post("/v1/chat/completions", CHAT, {"x-slo-ttft-ms": "1.5"}).answer()
    assert_error(bad, 400, "invalid_ttft_target")
    assert "x-slo-ttft-ms" in bad.body.decode()
    assert [e.get("ttft_outcome") for e in access_events] == ["refused", "failed", None]


def capped(monkeypatch: pytest.MonkeyPatch) -> Setup:
    """One leg at once on each instance, eight may wait; arrival and first byte on the Clock;
    eight completions served one after another, 0.1 s apart (10 decode slots freed a second,
    as the queue measures it)."""
    made = Setup(
        decode_max_in_flight=1,
        prefill_max_in_flight=1,
        queue_size=8,
        queue_timeout=30,
        tenant_header="x-team",
        tenants={"patient": {"ttft-miss": "serve"}},
    )
    now = SimpleNamespace(monotonic=made.clock.seconds)
    monkeypatch.setattr(intake, "time", now)
    monkeypatch.setattr(access, "time", now)
    for _ in range(8):
        assert made.post("/v1/chat/completions", CHAT).answer().status == 200
        made.clock.advance(0.1)
    return made


def test_a_request_predicted_to_miss_its_target_is_refused_at_once_with_retry_after(
    monkeypatch: pytest.MonkeyPatch, access_events: list[dict[str, Any]]
) -> None:
    setup = capped(monkeypatch)
    setup.decode.hold_answers()
    first = setup.post("/v1/chat/completions", CHAT)
    setup.proxy.flush()
    # Three other tenants wait (no target; one prefilled ahead, ready), each before it.
    waiting = [setup.post("/v1/chat/completions", CHAT, {"x-team": f"t{n}"}) for n in range(3)]
    setup.proxy.flush()
    # Three ahead at 10 a second: its first token in 0.3 s, past 100 ms.
    refused = setup.post("/v1/chat/completions", CHAT, {"x-slo-ttft-ms": "100"}).answer()
    assert_error(refused, 503, "ttft_unreachable")
    assert refused.values("Retry-After") == ["1"]
    # A tenant that would rather be late is served late.
    late = setup.post("/v1/chat/completions", CHAT, {"x-slo-ttft-ms": "100", "x-team": "patient"})
    setup.proxy.flush()
    setup.clock.advance(1)
    for _ in range(5):
        setup.decode.release()
        setup.proxy.flush()
    assert [c.answer().status for c in (first, *waiting, late)] == [200] * 5
    said = {e.get("ttft_outcome"): e for e in access_events[8:] if "ttft_outcome" in e}
    assert said["refused"]["ttft_predicted_ms"] == 300
    assert said["late"]["ttft_predicted_ms"] == 300  # (the refused one took no place)
    assert "predicted 300ms" in access.access_line(said["refused"])
    m = setup.scrape()
    assert m[("nixlproxy_admissions_total", (("outcome", "ttft_refused"),))] == 1
    assert (
        m[("nixlproxy_ttft_outcomes_total", (("outcome", "refused"), ("tenant_class", "default")))]
        == 1
    )
    assert m[("nixlproxy_ttft_prediction_ratio_count", ())] == 1  # (the one served)
    # Freed at 0, 0.1, ... 0.7 s, then five at 1.8 s: 12 intervals in 1.8 s.
    assert m[("nixlproxy_decode_drain_rate", (("model", ""),))] == pytest.approx(12 / 1.8)


def test_the_status_page_shows_the_rates_measured_and_a_new_requests_prediction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = capped(monkeypatch)
    setup.decode.hold_answers()
    clients = [setup.post("/v1/chat/completions", CHAT)]
    setup.proxy.flush()
    for n in range(2):
        clients.append(setup.post("/v1/chat/completions", CHAT, {"x-team": f"t{n}"}))
    setup.proxy.flush()
    said = json.loads(setup.get("/status.json").answer().body)
    (model,) = said["models"]
    assert model["measured"] == {
        "decode_drain_rate": pytest.approx(10.0),
        "prefill_seconds": 0.0,
        "first_byte_seconds": 0.0,
        "predicted_first_token_seconds": pytest.approx(0.2),  # (one ready, one waiting: 10/s)
    }
    page = setup.get("/").answer().body.decode()
    assert "measured: 10.0 decode slots freed/s" in page and "predicted in 200 ms" in page
    setup.decode.release()
    setup.proxy.flush()
    assert [c.answer().status for c in clients] == [200] * 3


def test_a_moved_answers_rest_waits_for_its_slot_and_is_never_refused_for_its_target() -> None:
    setup = Setup(
        tokens=6,
        decodes=2,
        decode_max_in_flight=1,
        queue_size=8,
        queue_timeout=30,
        stream_idle_timeout=2,
        tenant_header="x-team",
    )
    for _ in range(8):  # (10 decode slots freed a second, as the queue measures it)
        assert setup.post("/v1/chat/completions", CHAT).answer().status == 200
        setup.clock.advance(0.1)
    first, second = setup.decodes
    second.hold_answers()
    stream = dict(CHAT, stream=True)
    first.hold_streams_after(3)
    moving = setup.post("/v1/chat/completions", stream, {"x-slo-ttft-ms": "100"})
    setup.proxy.flush()
    setup.post("/v1/chat/completions", CHAT, {"x-team": "held"})  # (on the second)
    setup.proxy.flush()
    waiting = [setup.post("/v1/chat/completions", CHAT, {"x-team": f"t{n}"}) for n in range(3)]
    setup.proxy.flush()
    slots = setup.proxy.app.serving.legs.slots
    assert slots is not None and len(slots.queue) == 3
    # Silent for the idle timeout: its rest moves, and waits behind two (the first went).
    setup.proxy.advance(2)
    assert len(slots.queue) == 3
    first.release()
    second.release()
    setup.proxy.flush()
    answer = moving.answer()
    assert answer.complete and b"ttft_unreachable" not in answer.body
    assert [c.answer().status for c in waiting] == [200] * 3
