"""Batched /v1/completions: one prefill/decode pair per prompt, merged as vLLM would answer."""

from __future__ import annotations

from typing import Any

from nixl_twisted.observe.access import access_line
from tests.memory.support import Setup, assert_error, sse_events

PROMPTS = ["first prompt", "second prompt", "third prompt"]


def batch(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": PROMPTS, "max_tokens": 3, **extra}


def test_each_prompt_is_its_own_pair_and_the_answer_is_merged() -> None:
    setup = Setup(prefills=2, decodes=2, tokens=3)
    answer = setup.post("/v1/completions", batch()).answer()
    assert answer.status == 200
    assert [c["index"] for c in answer.json()["choices"]] == [0, 1, 2]
    assert answer.json()["usage"]["completion_tokens"] == 9
    prefills = [r for p in setup.prefills for r in p.requests_for("prefill")]
    decodes = [r for d in setup.decodes for r in d.requests_for("decode")]
    assert sorted(r.body["prompt"] for r in prefills if r.body) == sorted(PROMPTS)
    assert len(decodes) == 3
    assert len({r.request_id for r in prefills}) == 3  # its own id each
    assert len(answer.values("x-request-id")) == 1
    assert len(setup.ledger.redeemed) == 3


def test_each_part_has_the_batchs_id_and_its_index_on_its_legs_and_in_the_access_line(
    access_events: list[dict[str, Any]],
) -> None:
    setup = Setup(tokens=2)
    for sent in ({"X-Request-Id": "batch-9"}, {}):
        answer = setup.post("/v1/completions", batch(), headers=sent).answer()
        assert answer.status == 200
        (batch_id,) = answer.values("x-request-id")
        assert batch_id == sent.get("X-Request-Id", batch_id)
        part_ids = [f"{batch_id}-{index}" for index in range(len(PROMPTS))]
        legs = [r for r in setup.prefill.requests if r.body and r.body["prompt"] in PROMPTS]
        by_prompt = {r.body["prompt"]: r.request_id for r in legs if r.body}
        assert [by_prompt[prompt] for prompt in PROMPTS] == part_ids
        assert sorted(str(r.request_id) for r in setup.decode.requests_for("decode")) == part_ids
        setup.prefill.requests.clear()
        setup.decode.requests.clear()
        event = access_events.pop()
        assert event["request_id"] == batch_id
        assert [part.split()[:2] for part in event["parts"]] == [
            [f"{index}:", part_id] for index, part_id in enumerate(part_ids)
        ]
        assert "None" not in access_line(event)


def test_choice_indices_follow_prompt_index_times_n() -> None:
    setup = Setup(tokens=2)
    answer = setup.post("/v1/completions", batch(n=2)).answer()
    assert answer.status == 200
    assert [c["index"] for c in answer.json()["choices"]] == [0, 2, 4]


def test_a_streamed_batch_is_multiplexed_with_one_usage_and_one_done() -> None:
    setup = Setup(tokens=3)
    body = batch(stream=True, stream_options={"include_usage": True})
    client = setup.post("/v1/completions", body)
    assert client.answer().status == 200
    events = sse_events(client)
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
    (usage,) = [e for e in events[:-1] if not e["choices"]]
    assert usage["usage"]["completion_tokens"] == 9


def test_a_part_failing_first_fails_the_request_and_stops_the_others() -> None:
    setup = Setup(tokens=3)
    setup.prefill.crash_next(500, "engine died")
    answer = setup.post("/v1/completions", batch()).answer()
    assert answer.status == 502
    assert answer.json()["error"]["code"] == "prefill_failed"
    assert setup.proxy.app.in_flight == 0


def test_a_part_breaking_mid_stream_is_never_passed_off_as_complete() -> None:
    setup = Setup(tokens=5)
    setup.decode.break_next(after_events=2)
    client = setup.post("/v1/completions", batch(stream=True))
    assert not client.answer().complete and client.lost
    events = sse_events(client)
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == "batch_part_failed"


def test_more_prompts_than_the_limit_is_a_400_before_any_backend() -> None:
    setup = Setup(max_batch_prompts=2)
    assert_error(setup.post("/v1/completions", batch()).answer(), 400, "too_many_prompts")
    assert setup.prefill.requests == []


def test_a_client_leaving_cancels_every_part() -> None:
    setup = Setup(tokens=5)
    client = setup.held_stream(path="/v1/completions", body=batch(stream=True))
    parts = len(setup.decode.requests)
    client.disconnect()
    # vLLM sees each part's connection close, and frees its blocks.
    assert parts >= 1
    assert setup.decode.disconnects == parts
    assert setup.proxy.app.in_flight == 0


def test_choices_past_max_n_are_400_before_any_leg() -> None:
    # 32 prompts with n: 1000000 were sent on as 32 prefill legs.
    setup = Setup(max_n=4)
    many = {"model": "m", "prompt": [f"p{i}" for i in range(32)], "n": 1_000_000}
    for path, body in (
        ("/v1/completions", many),
        ("/v1/chat/completions", {"model": "m", "messages": [], "n": 5}),
        ("/v1/completions", {"model": "m", "prompt": "x", "best_of": 5.0}),
    ):
        assert_error(setup.post(path, body).answer(), 400, "too_many_choices")
    assert setup.prefill.requests == []
    answer = setup.post("/v1/completions", batch(n=4)).answer()
    assert answer.status == 200  # (at the bound: served)
    assert len(setup.prefill.requests) == len(PROMPTS)
