"""Multi-turn reuse through the proxy, against fakes that do vLLM's bidirectional transfer.

A conversation's next turn reads its earlier turns' KV back from the decode
that holds it: only where its prompt's ids extend what decode held, once,
within the handle's life, from the instance it pins; a handle never reaches
a client, with the option on or off.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from tests.memory.support import Setup

#: A conversation's opening: long enough that its handles cover whole digests (64 ids).
SYSTEM = {"role": "system", "content": "You answer questions on the NIXL transfer. " * 12}
FIRST = [SYSTEM, {"role": "user", "content": "How does decode pull the KV?"}]
HANDLE_WORDS = (b"kv_transfer_params", b"remote_block_ids", b"remote_engine_id")


def reusing(decodes: int = 2, ttl: float = 120.0, **options: Any) -> Setup:
    fakes = {"bidirectional": True, "decoder_blocks_ttl": ttl, **options.pop("fakes", {})}
    return Setup(
        decodes=decodes,
        fake_options=fakes,
        multi_turn_reuse=options.pop("on", True),
        reuse_handle_ttl=ttl,
        **options,
    )


def chat(setup: Setup, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    answer = setup.post(
        "/v1/chat/completions", {"model": "fake-model", "messages": messages, **extra}
    ).answer()
    assert answer.status == 200, answer.body
    assert answer.complete
    length = answer.headers.get("content-length")
    assert length is None or int(length) == len(answer.body)
    for word in HANDLE_WORDS:
        assert word not in answer.body  # (never a client's, whatever the options)
    said: dict[str, Any] = answer.json()
    return said


def next_turn(messages: list[dict[str, Any]], said: dict[str, Any]) -> list[dict[str, Any]]:
    content = said["choices"][0]["message"]["content"]
    asked = {"role": "user", "content": f"And after that? ({len(messages)})"}
    return [*messages, {"role": "assistant", "content": content}, asked]


def decode_legs(setup: Setup) -> list[int]:
    """Each decode instance's generation requests (two-leg or decode-only)."""
    return [len([r for r in d.requests if r.role != "other"]) for d in setup.decodes]


def answered(said: dict[str, Any]) -> tuple[Any, Any]:
    """What an answer says, apart from its id and time."""
    return said["choices"], said["usage"]


def test_a_next_turn_reads_its_kv_back_from_the_decode_that_holds_it(
    access_events: list[dict[str, Any]],
) -> None:
    setup = reusing()
    first = chat(setup, FIRST)
    assert decode_legs(setup) == [1, 0]
    assert len(setup.decode.handles_issued) == 1
    second = chat(setup, next_turn(FIRST, first))
    (read,) = setup.prefill.handles_read
    assert read["extends"] and not read["again"] and read["pulled"] > 0
    assert read["handle"] == setup.decode.handles_issued[0]  # (verbatim)
    assert decode_legs(setup) == [2, 0]  # (round-robin would have sent it to decode-1)
    assert setup.prefill.sources.external_kv_transfer == read["pulled"]
    assert access_events[-1]["reuse"] == "used"
    covered = setup.decode.handles_issued[0]["remote_num_tokens"]
    assert access_events[-1]["reused_tokens"] == covered
    # The same conversation without reuse: the same answers, token for token.
    plain = reusing(on=False)
    assert answered(chat(plain, FIRST)) == answered(first)
    assert answered(chat(plain, next_turn(FIRST, first))) == answered(second)
    assert plain.prefill.handles_read == []


def test_turn_after_turn_each_reads_the_one_before() -> None:
    setup = reusing()
    messages = FIRST
    said = chat(setup, messages)
    for _ in range(3):
        messages = next_turn(messages, said)
        said = chat(setup, messages)
    assert [r["extends"] for r in setup.prefill.handles_read] == [True, True, True]
    assert decode_legs(setup) == [4, 0]


def test_the_ids_the_proxy_asked_for_are_shown_as_the_client_would_have_them() -> None:
    setup = reusing()
    said = chat(setup, FIRST)
    assert said.get("prompt_token_ids") is None
    assert said["choices"][0].get("token_ids") is None
    asked = chat(setup, FIRST, return_token_ids=True)
    assert asked["prompt_token_ids"] and asked["choices"][0]["token_ids"]


def test_a_next_turn_whose_earlier_message_changed_reads_nothing(
    access_events: list[dict[str, Any]],
) -> None:
    setup = reusing()
    first = chat(setup, FIRST)
    changed = next_turn(FIRST, first)
    changed[1] = {"role": "user", "content": "How does prefill push the KV?"}
    second = chat(setup, changed)
    assert setup.prefill.handles_read == []
    assert access_events[-1]["reuse"] in ("none", "mismatch")
    plain = reusing(on=False)
    chat(plain, FIRST)
    assert answered(chat(plain, changed)) == answered(second)


def test_a_handle_is_read_once(access_events: list[dict[str, Any]]) -> None:
    setup = reusing()
    second = next_turn(FIRST, chat(setup, FIRST))
    setup.prefill.hold_answers()  # (both find the handle before either's prefill answers)
    body = {"model": "fake-model", "messages": second}
    clients = [setup.post("/v1/chat/completions", body) for _ in range(2)]  # (a retry)
    setup.prefill.release()
    setup.proxy.flush()
    answers = [client.answer() for client in clients]
    assert [answer.status for answer in answers] == [200, 200]
    (read,) = setup.prefill.handles_read
    assert not read["again"]
    assert sorted(e["reuse"] for e in access_events[-2:]) == ["none", "used"]
    assert answered(answers[0].json()) == answered(answers[1].json())


def test_a_handle_is_never_offered_past_its_life_less_the_margin(
    access_events: list[dict[str, Any]],
) -> None:
    setup = reusing(ttl=120.0)
    second = next_turn(FIRST, chat(setup, FIRST))
    setup.proxy.advance(110.0)  # (decode still holds it for 10 s: too close to read)
    chat(setup, second)
    assert setup.prefill.handles_read == []
    assert access_events[-1]["reuse"] == "expired"


def test_a_prefill_that_fails_with_a_handle_is_sent_again_without_it(
    access_events: list[dict[str, Any]],
) -> None:
    # Decode let the blocks go sooner than the proxy was told: prefill's read fails (500).
    setup = reusing(ttl=120.0, fakes={"decoder_blocks_ttl": 30.0})
    first = chat(setup, FIRST)
    setup.proxy.advance(60.0)
    second = chat(setup, next_turn(FIRST, first))
    assert len(setup.prefill.requests_for("prefill")) == 3  # (turn 1; turn 2 with, without)
    assert setup.prefill.sources.failed_transfers == 1
    assert access_events[-1]["reuse"] == "failed"
    assert second["choices"][0]["finish_reason"] is not None
    assert setup.proxy.app.serving.legs.backends.prefill.available(
        setup.proxy.app.serving.legs.backends.prefill.instances[0]
    )


def test_a_follow_up_decided_decode_alone_goes_to_the_instance_that_holds_it(
    access_events: list[dict[str, Any]],
) -> None:
    setup = reusing()
    first = chat(setup, FIRST)
    legs = setup.proxy.app.serving.legs
    config = legs.config
    rules = replace(config.disaggregation, short_prompt=1_000_000)
    legs.configure(replace(config, disaggregation=rules))  # (every prompt decode-only now)
    second_turn = next_turn(FIRST, first)
    second = chat(setup, second_turn)
    assert decode_legs(setup) == [2, 0] and access_events[-1]["mode"] == "decode_only"
    assert access_events[-1]["reuse"] == "decode_only"
    legs.configure(config)  # (two legs again: the handle was left for the turn after)
    chat(setup, next_turn(second_turn, second))
    (read,) = setup.prefill.handles_read
    assert read["extends"] and access_events[-1]["reuse"] == "used"


def test_another_tenants_conversation_never_reads_it(
    access_events: list[dict[str, Any]],
) -> None:
    setup = reusing(tenant_header="X-Tenant")
    answer = setup.post(
        "/v1/chat/completions",
        {"model": "fake-model", "messages": FIRST},
        {"X-Tenant": "acme"},
    ).answer()
    second = next_turn(FIRST, answer.json())
    other = setup.post(
        "/v1/chat/completions",
        {"model": "fake-model", "messages": second},
        {"X-Tenant": "globex"},
    ).answer()
    assert other.status == 200
    assert setup.prefill.handles_read == [] and access_events[-1]["reuse"] == "none"


def test_a_streamed_answer_leaves_its_handle_on_vllm_033() -> None:
    setup = reusing(fakes={"streams_handle": True})
    answer = setup.post(
        "/v1/chat/completions", {"model": "fake-model", "messages": FIRST, "stream": True}
    ).answer()
    assert answer.status == 200 and answer.complete
    for word in (*HANDLE_WORDS, b'"token_ids":['):
        assert word not in answer.body
    content = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in answer.body.decode().split("\n")
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )
    chat(setup, next_turn(FIRST, {"choices": [{"message": {"content": content}}]}))
    (read,) = setup.prefill.handles_read
    assert read["extends"]


def test_a_prompt_of_ids_extends_by_its_ids() -> None:
    setup = reusing()
    prompt = list(range(100, 300))
    body = {"model": "fake-model", "prompt": prompt, "return_token_ids": True}
    first = setup.post("/v1/completions", body).answer().json()
    after = [*prompt, *first["choices"][0]["token_ids"], 7, 8, 9]
    assert setup.post("/v1/completions", dict(body, prompt=after)).answer().status == 200
    (read,) = setup.prefill.handles_read
    assert read["extends"]
    assert not any(r.path.endswith("/render") for r in setup.prefill.requests)


def test_handles_are_taken_out_with_the_option_off_too() -> None:
    setup = reusing(on=False, fakes={"streams_handle": True})
    chat(setup, FIRST)
    streamed = setup.post(
        "/v1/chat/completions", {"model": "fake-model", "messages": FIRST, "stream": True}
    ).answer()
    responses = setup.post(
        "/v1/responses", {"model": "fake-model", "input": "How does decode pull the KV?"}
    ).answer()
    responses_streamed = setup.post(
        "/v1/responses",
        {"model": "fake-model", "input": "How does decode pull the KV?", "stream": True},
    ).answer()
    for answer in (streamed, responses, responses_streamed):
        assert answer.status == 200 and answer.complete
        for word in HANDLE_WORDS:
            assert word not in answer.body
    assert len(setup.decode.handles_issued) + len(setup.decodes[1].handles_issued) == 4
    assert setup.scrape()[("nixlproxy_reuse_handles_total", (("outcome", "off"),))] == 4
    status = setup.get("/status.json").answer().json()
    assert status["reuse"]["on"] is False and status["reuse"]["handles"] == {"off": 4}
    assert b"yet decode answered 4 handles" in setup.get("/").answer().body


def test_the_status_page_says_what_came_of_reuse() -> None:
    setup = reusing()
    chat(setup, next_turn(FIRST, chat(setup, FIRST)))
    status = setup.get("/status.json").answer().json()
    assert status["reuse"]["lookups"] == {"none": 1, "used": 1}
    assert status["reuse"]["handles"] == {"kept": 2}
    assert status["reuse"]["tokens_read"] > 0
    assert status["reuse"]["kept_here"] == 1  # (turn 2's, for turn 3)


def test_a_conversation_with_an_image_is_never_read_back() -> None:
    # (an image's placeholder ids are the same for another image of its size)
    setup = reusing()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    seen: list[dict[str, Any]] = [
        SYSTEM,
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]},
    ]
    chat(setup, next_turn(seen, chat(setup, seen)))
    assert setup.prefill.handles_read == []
    handles = setup.scrape()[("nixlproxy_reuse_handles_total", (("outcome", "no_token_ids"),))]
    assert handles == 2


def test_a_stored_response_is_read_back_without_its_handle() -> None:
    # (vLLM stores the whole response, decode's handle in it, and answers it as stored)
    setup = reusing(decodes=1)
    made = setup.post("/v1/responses", {"model": "fake-model", "input": "How?"}).answer()
    response_id = made.json()["id"]
    (stored,) = setup.decode.responses.values()
    assert "kv_transfer_params" in stored  # (the fake keeps it, as vLLM does)
    again = setup.get(f"/v1/responses/{response_id}").answer()
    assert again.status == 200 and again.complete
    assert int(again.headers["content-length"]) == len(again.body)
    for word in HANDLE_WORDS:
        assert word not in again.body
    assert again.json()["id"] == response_id


def test_handles_prefill_cannot_read_are_warned_of_once(logged: list[dict[str, Any]]) -> None:
    setup = reusing(ttl=120.0, fakes={"decoder_blocks_ttl": 30.0})
    openings = [FIRST, [SYSTEM, {"role": "user", "content": "And how does prefill push it?"}]]
    firsts = [chat(setup, opening) for opening in openings]
    setup.proxy.advance(60.0)
    for opening, first in zip(openings, firsts, strict=True):
        chat(setup, next_turn(opening, first))
    assert setup.prefill.sources.failed_transfers == 2
    warned = [e for e in logged if "with decode's handle" in e.get("log_format", "")]
    assert len(warned) == 1


def test_a_handle_whose_decode_went_down_is_not_read(
    access_events: list[dict[str, Any]],
) -> None:
    # (its blocks went with it: the turn is served as without reuse, elsewhere)
    setup = reusing()
    second = next_turn(FIRST, chat(setup, FIRST))
    pool = setup.proxy.app.serving.legs.backends.decode
    holder = pool.instances[0]
    for _ in range(3):  # (--unhealthy-threshold failures in a row: down)
        pool.record_failure(holder, "connection refused")
    assert not pool.available(holder)
    said = chat(setup, second)
    assert setup.prefill.handles_read == [] and access_events[-1]["reuse"] == "gone"
    assert decode_legs(setup) == [1, 1]
    assert said["choices"][0]["finish_reason"] is not None
