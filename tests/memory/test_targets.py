"""First-token targets measured: the access event and the outcomes metric, by a Clock."""

from __future__ import annotations

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
