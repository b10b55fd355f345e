"""Decode first, then whether to disaggregate: each rule, the fallback, and the default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from nixl_twisted.config import ProxyConfig, resolve
from nixl_twisted.protocol import routes
from nixl_twisted.run.root import build
from tests.memory.support import CHAT, Setup, assert_error, sse_events

SHORT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
#: About 500 estimated tokens.
LONG = {"model": "fake-model", "messages": [{"role": "user", "content": "tell me more " * 150}]}


def decisions(setup: Setup) -> dict[tuple[str, str], float]:
    """``nixlproxy_disaggregation_decisions_total`` by (decision, reason)."""
    return {
        (dict(labels)["decision"], dict(labels)["reason"]): value
        for (name, labels), value in setup.scrape().items()
        if name == "nixlproxy_disaggregation_decisions_total"
    }


def completions_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The access events of the completions (not of the tests' own scrapes)."""
    return [event for event in events if event["path"] != routes.METRICS]


def roles(fake: Any) -> list[str]:
    return [r.role for r in fake.requests if r.role != "other"]


def test_by_default_every_request_takes_two_legs_and_says_so(
    access_events: list[dict[str, Any]],
) -> None:
    setup = Setup()
    assert setup.post(routes.CHAT_COMPLETIONS, SHORT).answer().status == 200
    assert roles(setup.prefill) == ["prefill"]
    assert roles(setup.decode) == ["decode"]
    assert decisions(setup) == {("pd", "always"): 1.0}
    (event,) = completions_of(access_events)
    assert (event["mode"], event["decided_by"]) == ("pd", "always")


def test_the_decode_instance_is_chosen_and_held_before_prefill_runs() -> None:
    setup = Setup(decodes=2)
    setup.prefill.hold_answers()
    client = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    assert setup.phase() == "prefill"
    held = [i.in_flight for i in setup.proxy.service.backends.decode.instances]
    assert sorted(held) == [0, 1]  # one decode instance is taken for this request already
    setup.prefill.release()
    setup.proxy.flush()
    assert client.answer().status == 200
    (served,) = [d for d in setup.decodes if d.requests_for("decode")]
    chosen = setup.proxy.service.backends.decode.instances[held.index(1)]
    assert served.url == chosen.url
    assert [i.in_flight for i in setup.proxy.service.backends.decode.instances] == [0, 0]


def test_a_client_leaving_during_prefill_gives_its_decode_instance_back() -> None:
    setup = Setup()
    setup.prefill.hold_answers()
    client = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    client.disconnect()
    setup.prefill.release()
    setup.proxy.flush()
    assert setup.decode.requests_for("decode") == []
    assert setup.proxy.service.backends.decode.instances[0].in_flight == 0
    assert setup.proxy.app.in_flight == 0


def test_no_decode_instance_is_a_503_before_any_prefill() -> None:
    setup = Setup(decodes=1)
    setup.proxy.service.backends.decode.instances[0].draining = True
    answer = setup.post(routes.CHAT_COMPLETIONS, CHAT).answer()
    assert_error(answer, 503, "no_healthy_decode")
    assert setup.prefill.requests == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (routes.CHAT_COMPLETIONS, SHORT),
        (routes.COMPLETIONS, {"model": "fake-model", "prompt": "hi", "max_tokens": 3}),
        (routes.COMPLETIONS, {"model": "fake-model", "prompt": [1, 2, 3], "max_tokens": 3}),
        (routes.RESPONSES, {"model": "fake-model", "input": "hi"}),
        (routes.MESSAGES, {"model": "fake-model", "max_tokens": 3, "messages": SHORT["messages"]}),
    ],
)
def test_a_short_prompt_goes_to_decode_alone_on_every_two_leg_route(
    path: str, body: dict[str, Any], access_events: list[dict[str, Any]]
) -> None:
    setup = Setup(decode_only_below=64)
    own = dict(body, kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [1]})
    answer = setup.post(path, own).answer()
    assert answer.status == 200, answer.body
    assert setup.prefill.requests == []
    (served,) = setup.decode.requests
    assert served.role == "plain"  # computed there: no kv_transfer_params at all
    assert served.body is not None and "kv_transfer_params" not in served.body
    assert served.request_id == answer.values("x-request-id")[0]
    assert decisions(setup) == {("decode_only", "short_prompt"): 1.0}
    (event,) = completions_of(access_events)
    assert (event["mode"], event["decided_by"]) == ("decode_only", "short_prompt")
    assert "prefill" not in event


def test_a_long_prompt_still_takes_two_legs_when_the_rule_is_on() -> None:
    setup = Setup(decode_only_below=64)
    assert setup.post(routes.CHAT_COMPLETIONS, LONG).answer().status == 200
    assert roles(setup.prefill) == ["prefill"]
    assert roles(setup.decode) == ["decode"]
    assert decisions(setup) == {("pd", "long_prompt"): 1.0}


def test_a_decode_only_stream_is_relayed_whole() -> None:
    setup = Setup(tokens=4, decode_only_below=64)
    body = dict(SHORT, stream=True, stream_options={"include_usage": True})
    client = setup.post(routes.CHAT_COMPLETIONS, body)
    events = sse_events(client)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 4
    assert roles(setup.decode) == ["plain"]


def test_a_decode_only_leg_retries_on_another_decode_instance() -> None:
    setup = Setup(decodes=2, decode_only_below=64)
    setup.proxy.stop_serving(setup.decodes[0])
    for _ in range(2):  # whichever instance is chosen first
        assert setup.post(routes.CHAT_COMPLETIONS, SHORT).answer().status == 200
    assert roles(setup.decodes[1]) == ["plain", "plain"]
    assert setup.prefill.requests == []


def test_a_pd_request_whose_chosen_decode_is_unreachable_goes_to_another() -> None:
    setup = Setup(decodes=2)
    setup.proxy.stop_serving(setup.decodes[0])
    for _ in range(2):
        assert setup.post(routes.CHAT_COMPLETIONS, CHAT).answer().status == 200
    assert roles(setup.decodes[1]) == ["decode", "decode"]
    assert [i.in_flight for i in setup.proxy.service.backends.decode.instances] == [0, 0]


def test_prefill_fallback_serves_decode_only_once_every_prefill_retry_is_spent(
    access_events: list[dict[str, Any]],
) -> None:
    setup = Setup(prefills=2, prefill_fallback="decode", prefill_retries=1)
    for prefill in setup.prefills:
        prefill.crash_next(503, "overloaded")
    answer = setup.post(routes.CHAT_COMPLETIONS, CHAT).answer()
    assert answer.status == 200
    assert [roles(p) for p in setup.prefills] == [["prefill"], ["prefill"]]
    assert roles(setup.decode) == ["plain"]
    assert decisions(setup) == {("decode_only", "prefill_unavailable"): 1.0}
    (event,) = completions_of(access_events)
    assert event["decided_by"] == "prefill_unavailable"
    assert len(event["attempts"]) == 3  # two prefill attempts, then decode


def test_without_the_fallback_spent_prefill_retries_are_a_503_as_always() -> None:
    setup = Setup(prefills=2, prefill_retries=1)
    for prefill in setup.prefills:
        prefill.crash_next(502, "restarting")
    answer = setup.post(routes.CHAT_COMPLETIONS, CHAT).answer()
    assert_error(answer, 502, "prefill_failed")
    assert setup.decode.requests == []
    assert decisions(setup) == {("pd", "always"): 1.0}
    assert setup.proxy.service.backends.decode.instances[0].in_flight == 0


def test_prefill_fallback_skips_a_prefill_pool_that_is_all_down() -> None:
    setup = Setup(prefills=1, prefill_fallback="decode")
    setup.proxy.stop_serving(setup.prefill)
    assert setup.post(routes.CHAT_COMPLETIONS, CHAT).answer().status == 200
    assert decisions(setup) == {("decode_only", "prefill_unavailable"): 1.0}
    setup.proxy.service.backends.prefill.instances[0].draining = True
    assert setup.post(routes.CHAT_COMPLETIONS, CHAT).answer().status == 200
    assert decisions(setup) == {("decode_only", "prefill_unavailable"): 2.0}
    assert roles(setup.decode) == ["plain", "plain"]


def test_prefill_fallback_does_not_hide_what_the_request_or_a_timeout_caused() -> None:
    setup = Setup(prefill_fallback="decode", prefill_timeout=5)
    setup.prefill.refuse_next(400, "max_tokens is too large")
    assert setup.post(routes.CHAT_COMPLETIONS, CHAT).answer().status == 400
    setup.prefill.hold_answers()
    client = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.advance(5)
    assert_error(client.answer(), 504, "prefill_timeout")
    assert setup.decode.requests == []
    assert decisions(setup) == {("pd", "always"): 2.0}


def test_while_every_prefill_is_busy_short_ish_prompts_go_decode_only() -> None:
    setup = Setup(decode_only_busy_below=1000, prefill_busy_at=2)
    setup.prefill.hold_answers()
    held = [setup.post(routes.CHAT_COMPLETIONS, LONG) for _ in range(2)]  # prefill at 2 legs
    setup.proxy.flush()
    assert setup.post(routes.CHAT_COMPLETIONS, LONG).answer().status == 200
    assert roles(setup.decode) == ["plain"]
    huge = {"model": "fake-model", "messages": [{"role": "user", "content": "x" * 8000}]}
    third = setup.post(routes.CHAT_COMPLETIONS, huge)  # too long for the rule: waits its turn
    setup.prefill.release()
    setup.proxy.flush()
    assert [c.answer().status for c in [*held, third]] == [200, 200, 200]
    assert decisions(setup) == {("decode_only", "prefill_busy"): 1.0, ("pd", "long_prompt"): 3.0}


def test_the_busy_rule_reads_the_prefill_queue_vllm_reports() -> None:
    setup = Setup(start=False, decode_only_busy_below=1000, prefill_busy_at=3, health_interval=1)
    setup.prefill.waiting = 3
    setup.proxy.start()
    assert setup.proxy.service.backends.prefill.instances[0].load["waiting"] == 3.0
    assert setup.post(routes.CHAT_COMPLETIONS, LONG).answer().status == 200
    assert decisions(setup) == {("decode_only", "prefill_busy"): 1.0}
    setup.prefill.waiting = 0
    setup.proxy.advance(1)
    assert setup.post(routes.CHAT_COMPLETIONS, LONG).answer().status == 200
    assert decisions(setup)[("pd", "long_prompt")] == 1.0


def test_each_part_of_a_batch_decides_for_itself(access_events: list[dict[str, Any]]) -> None:
    setup = Setup(decode_only_below=64)
    prompts = ["short one", "a long one " * 100]
    answer = setup.post(
        routes.COMPLETIONS, {"model": "fake-model", "prompt": prompts, "max_tokens": 2}
    )
    assert answer.answer().status == 200
    assert [r.body["prompt"] for r in setup.prefill.requests if r.body] == [prompts[1]]
    assert sorted(roles(setup.decode)) == ["decode", "plain"]
    assert decisions(setup) == {("decode_only", "short_prompt"): 1.0, ("pd", "long_prompt"): 1.0}
    (event,) = completions_of(access_events)
    assert "decode_only (short_prompt)" in event["parts"][0]
    assert "decode_only" not in event["parts"][1]


def test_a_reload_changes_the_thresholds_for_the_next_request() -> None:
    setup = Setup()
    assert setup.post(routes.CHAT_COMPLETIONS, SHORT).answer().status == 200
    service = setup.proxy.service
    urls = {
        "prefill": list(service.config.pools.prefill),
        "decode": list(service.config.pools.decode),
    }
    service.reconfigure(ProxyConfig.create(**urls, health_interval=0, decode_only_below=64))
    assert setup.post(routes.CHAT_COMPLETIONS, SHORT).answer().status == 200
    assert decisions(setup) == {("pd", "always"): 1.0, ("decode_only", "short_prompt"): 1.0}
    assert roles(setup.decode) == ["decode", "plain"]


def test_the_uncached_rule_says_once_that_it_cannot_see_what_decode_caches(
    tmp_path: Path, logged: list[dict[str, Any]]
) -> None:
    path = tmp_path / "nixlproxy.toml"
    pools = 'prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n'
    path.write_text(pools)
    config = resolve({"health-interval": 0}, str(path), {})
    service = build(config, MemoryReactorClock(), clock=Clock(), take_signals=False)
    path.write_text(pools + "decode-only-uncached-below = 64\ndecode-only-below = 32\n")
    service.reload()
    service.reload()  # nothing changed: nothing said again
    blind = [e for e in logged if "does nothing" in str(e.get("blind", ""))]
    assert len(blind) == 1 and blind[0]["log_level"].name == "warn"
    assert service.app.serving.legs.config.disaggregation.short_prompt == 32


def test_a_decode_only_body_refused_at_encoding_gives_its_decode_instance_back() -> None:
    setup = Setup(decode_only_below=64)
    refused = 0
    for depth in range(900, 1000, 4):  # somewhere here the parse passes and the encoding not
        nested = "[" * depth + '"hi"' + "]" * depth
        raw = '{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "extra": %s}'
        answer = setup.post(routes.CHAT_COMPLETIONS, (raw % nested).encode()).answer()
        refused += answer.status == 400
    assert refused > 0
    assert setup.proxy.service.backends.decode.instances[0].in_flight == 0


class SlowRefusal(Resource):
    """A prefill instance whose 503 sends its headers, then its body when told."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[Request] = []

    def render_POST(self, request: Request) -> object:
        request.setResponseCode(503)
        request.setHeader(b"content-length", b"2")
        request.write(b"{")
        self.waiting.append(request)
        return NOT_DONE_YET

    def finish(self) -> None:
        for request in self.waiting:
            request.write(b"}")
            request.finish()


def test_a_client_gone_before_the_fallback_is_not_served_decode_only() -> None:
    setup = Setup(prefill_fallback="decode", prefill_retries=0)
    refusal = SlowRefusal()
    setup.proxy.serve(setup.prefill, refusal)
    client = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    assert setup.phase() == "handoff"  # prefill answered: its body is being read
    client.disconnect()
    refusal.finish()
    setup.proxy.flush()
    assert setup.decode.requests == []
    assert setup.proxy.service.backends.decode.instances[0].in_flight == 0
    assert setup.proxy.app.in_flight == 0


@pytest.mark.parametrize("leaves", ["drain", "remove"])
def test_a_decode_instance_that_leaves_while_prefill_runs_is_not_sent_the_leg(
    leaves: str,
) -> None:
    setup = Setup(decodes=2)
    setup.prefill.hold_answers()
    client = setup.post(routes.CHAT_COMPLETIONS, CHAT)
    setup.proxy.flush()
    pool = setup.proxy.service.backends.decode
    (chosen,) = [i for i in pool.instances if i.in_flight == 1]
    getattr(pool, leaves)(chosen.url)
    setup.prefill.release()
    setup.proxy.flush()
    assert client.answer().status == 200
    (served,) = [d for d in setup.decodes if d.requests_for("decode")]
    assert served.url != chosen.url
    assert chosen.in_flight == 0
    assert chosen not in pool.instances  # drained: gone once its leg is given back
