"""The silent recompute caught: decode's own counters, read by the health loop, judged."""

from __future__ import annotations

from typing import Any

from twisted.logger import LogLevel, formatEvent

from nixl_twisted.backends.recompute import WINDOW
from tests.memory.support import Setup

#: A prompt of about 1000 tokens (the fakes and the proxy count four bytes a token).
LONG = {"model": "fake-model", "prompt": "many words " * 360, "max_tokens": 4}
INTERVAL = 5.0


def rounds(setup: Setup, count: int) -> None:
    """Let ``count`` health intervals pass, each round's checks and scrapes answered."""
    for _ in range(count):
        setup.proxy.advance(INTERVAL)


def warnings(logged: list[dict[str, Any]]) -> list[str]:
    return [
        formatEvent(e)
        for e in logged
        if e.get("log_level") == LogLevel.warn and "computed" in e.get("log_format", "")
    ]


def ratio(setup: Setup) -> float | None:
    url = setup.decode.url
    return setup.scrape().get(("nixlproxy_decode_recompute_ratio", (("instance", url),)))


def test_decode_recomputing_p_d_legs_is_said_once_per_episode(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup(health_interval=INTERVAL)
    setup.settle(setup.proxy.service.checks.first_round())
    setup.decode.recompute_silently = True
    for _ in range(3):
        assert setup.post("/v1/completions", LONG).answer().status == 200
    setup.prefill.sources.expired_leases += 2  # (vLLM counts them on prefill)
    rounds(setup, 2)
    (said,) = warnings(logged)
    assert said.startswith(f"decode instance {setup.decode.url} computed 100% of the prompt")
    assert "Likely causes: KV leases that expired on prefill before decode pulled them" in said
    assert f"({setup.prefill.url} 2: a decode that never pulled" in said
    assert "side channel" in said
    assert ratio(setup) == 1.0
    episodes = ("nixlproxy_decode_recompute_episodes_total", (("instance", setup.decode.url),))
    assert setup.scrape()[episodes] == 1
    for _ in range(3):  # still recomputing: no second line
        setup.post("/v1/completions", LONG).answer()
        rounds(setup, 1)
    assert len(warnings(logged)) == 1

    # The handoff mended: once the window holds only pulled prompts, the episode ends.
    setup.decode.recompute_silently = False
    rounds(setup, int(WINDOW / INTERVAL) + 1)
    for _ in range(3):
        setup.post("/v1/completions", LONG).answer()
    rounds(setup, 1)
    assert ratio(setup) == 0.0
    ended = [formatEvent(e) for e in logged if "pulls the KV" in e.get("log_format", "")]
    assert len(ended) == 1
    assert len(warnings(logged)) == 1


def test_decode_only_requests_the_proxy_sent_are_not_a_recompute(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup(health_interval=INTERVAL, decode_only_below=100_000)
    setup.settle(setup.proxy.service.checks.first_round())
    for turn in range(4):
        own = dict(LONG, prompt=f"conversation {turn}: {LONG['prompt']}")
        assert setup.post("/v1/completions", own).answer().status == 200
    rounds(setup, 2)
    assert setup.decode.sources.local_compute > 3000  # decode computed them, on purpose
    assert setup.prefill.requests == []
    assert warnings(logged) == []
    assert ratio(setup) == 0.0
