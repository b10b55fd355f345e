"""Where a migration stops: what is refused, how often, until when; the slots it holds; what
it says of itself (the access event, the metric, the trace)."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.logger import LogLevel, formatEvent

from nixl_twisted.observe.access import access_line
from nixl_twisted.testing.prefix_cache import prompt_tokens
from tests.memory.migrations import STREAMS, TOKENS, assert_same_answer, uninterrupted
from tests.memory.support import TIMEOUTS, Setup, sse_events
from tests.memory.test_tracing import Traced, attributes

CHAT = "/v1/chat/completions"
STREAM = STREAMS[CHAT]
#: Its prompt's tokens, as the fakes count them (the whole answer's usage says these).
PROMPT = len(prompt_tokens(STREAM))


def migrations(setup: Setup) -> dict[str, float]:
    """``nixlproxy_migrations_total`` by outcome."""
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in setup.scrape().items()
        if name == "nixlproxy_migrations_total"
    }


@pytest.mark.parametrize(
    ("asked", "why"),
    [
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_object"}}, "structured_output"),
        ({"seed": 7, "temperature": 0.8}, "seeded_sampling"),
        ({"stop": ["."]}, "stop_strings"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"presence_penalty": 0.5}, "penalties"),
    ],
)
def test_what_no_continuation_carries_ends_mid_stream_as_it_always_did(
    asked: dict[str, Any], why: str, access_events: list[dict[str, Any]]
) -> None:
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(2)
    client = setup.post(CHAT, dict(STREAM, **asked))

    assert not client.answer().complete and client.lost
    assert sse_events(client)[-1]["error"]["code"] == "decode_stream_broken"
    assert setup.decodes[1].requests == []
    (event,) = access_events
    assert event["migration"] == f"refused ({why})" and event["ended"] == "broken"
    assert migrations(setup) == {"refused": 1}
    # Never asked for token ids: its decode leg is as without migrations.
    assert "return_token_ids" not in (setup.decodes[0].requests[0].body or {})


def test_a_stream_that_cannot_move_after_its_first_token_moves_before_it() -> None:
    body = dict(STREAM, seed=7, temperature=0.8)  # (vLLM's seeded draws restart on a new request)
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(0)  # its role sent, no token
    answer = setup.post(CHAT, body).answer()
    assert answer.complete
    assert_same_answer(answer.body, uninterrupted(CHAT, body))


def test_a_seeded_greedy_stream_moves_at_any_token() -> None:
    body = dict(STREAM, seed=7, temperature=0)
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(3)
    assert_same_answer(setup.post(CHAT, body).answer().body, uninterrupted(CHAT, body))


def test_a_batchs_part_never_moves(access_events: list[dict[str, Any]]) -> None:
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(1)
    body = {"model": "m", "prompt": ["a b c", "d e f"], "max_tokens": 3, "stream": True}
    client = setup.post("/v1/completions", body)
    assert not client.answer().complete
    assert sse_events(client)[-1]["error"]["code"] == "batch_part_failed"
    (event,) = access_events
    assert any("ended=broken" in part for part in event["parts"])
    assert migrations(setup) == {"refused": 1}


def test_an_answer_that_fails_again_ends_with_the_error_after_n_moves(
    access_events: list[dict[str, Any]],
) -> None:
    setup = Setup(tokens=TOKENS, decodes=3, decode_migrations=2)
    for decode in setup.decodes:
        decode.die_after_next(1)
    client = setup.post(CHAT, STREAM)

    assert not client.answer().complete and client.lost
    events = sse_events(client)
    assert events[-1]["error"]["code"] == "decode_stream_broken"
    words = [e["choices"][0]["delta"].get("content") for e in events[:-1] if e["choices"]]
    assert words == ["", "Hello ", "from ", "the "]  # one token from each, none twice
    (event,) = access_events
    d0, d1, d2 = (decode.url for decode in setup.decodes)
    assert event["migrations"] == [f"{d0}@1 -> {d1} failed (0 ms)", f"{d1}@2 -> {d2} failed (0 ms)"]
    assert event["migration"] == "exhausted"
    assert migrations(setup) == {"failed": 2, "exhausted": 1}


def test_a_continuation_refused_by_its_decode_is_a_failed_move() -> None:
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(2)
    setup.decodes[1].crash_next(500, "KV load failed")
    client = setup.post(CHAT, STREAM)
    assert sse_events(client)[-1]["error"]["code"] == "decode_stream_broken"
    assert migrations(setup) == {"failed": 1, "exhausted": 1}


def test_no_move_past_the_deadline(access_events: list[dict[str, Any]]) -> None:
    setup = Setup(tokens=TOKENS, decodes=2, migration_deadline=30)
    client = setup.held_stream(setup.decodes[0], after=3, path=CHAT, body=STREAM)
    setup.proxy.advance(TIMEOUTS.stream_idle)  # silent for the idle timeout: 60 s old
    assert sse_events(client)[-1]["error"]["code"] == "decode_timeout"
    (event,) = access_events
    assert event["migration"] == "past_deadline"
    setup.decodes[0].release()


def test_the_slots_go_from_the_failed_instance_to_the_next_through_the_queue() -> None:
    setup = Setup(tokens=TOKENS, decodes=2, decode_max_in_flight=1)
    first, second = setup.decodes
    first.die_after_next(2)
    second.hold_streams_after(2)  # (the continuation's: its role dropped, one token)
    held = second.stream_held()
    client = setup.post(CHAT, STREAM)
    assert held.called
    instances = setup.proxy.service.backends.decode.instances
    assert [i.in_flight for i in instances] == [0, 1]  # the failed one given back
    assert setup.proxy.app.serving.queues() == []
    second.release()
    setup.proxy.flush()
    assert client.answer().complete
    assert [i.in_flight for i in instances] == [0, 0]


def test_a_move_says_both_instances_and_the_token(access_events: list[dict[str, Any]]) -> None:
    setup = Traced(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(4)
    setup.post(CHAT, STREAM).answer()

    (event,) = access_events
    d0, d1 = (decode.url for decode in setup.decodes)
    assert event["migrations"] == [f"{d0}@4 -> {d1} completed (0 ms)"]
    assert f"migrated=[{d0}@4 -> {d1} completed (0 ms)]" in access_line(event)
    assert event["decode"] == d1
    assert (event["prompt_tokens"], event["completion_tokens"]) == (PROMPT, TOKENS)
    assert migrations(setup) == {"completed": 1}
    assert setup.scrape()[("nixlproxy_migration_seconds_count", ())] == 1
    decodes = [span for span in setup.finished() if span.name == "decode"]
    assert [attributes(span).get("nixlproxy.migration") for span in decodes] == [None, 1]
    moved = attributes(decodes[1])
    assert (moved["nixlproxy.migrated_at_token"], moved["nixlproxy.migrated_from"]) == (4, d0)


def test_a_tenants_hidden_usage_counts_the_whole_moved_answer(
    access_events: list[dict[str, Any]],
) -> None:
    body = dict(STREAM, stream_options=None)
    setup = Setup(tokens=TOKENS, decodes=2, tenant_header="x-team", tenant_tokens_per_minute=10**6)
    setup.decodes[0].die_after_next(3)
    answer = setup.post(CHAT, body, {"x-team": "team-a"}).answer()
    assert b'"usage"' not in answer.body  # (asked for the proxy's sake, not shown)
    (event,) = access_events
    assert (event["prompt_tokens"], event["completion_tokens"]) == (PROMPT, TOKENS)


def test_off_the_legs_are_protocol_version_2s() -> None:
    setup = Setup(tokens=TOKENS, decodes=2, decode_migrations=0)
    setup.post(CHAT, STREAM).answer()
    (decode,) = setup.decodes[0].requests
    assert decode.body is not None and "return_token_ids" not in decode.body


def test_a_whole_answer_that_breaks_again_is_a_502_never_a_short_200() -> None:
    setup = Setup(tokens=TOKENS, decodes=2)
    for decode in setup.decodes:
        decode.break_next()  # (its JSON closed halfway)
    answer = setup.post(CHAT, dict(STREAM, stream=False, stream_options=None)).answer()
    assert answer.status == 502 and answer.json()["error"]["code"] == "decode_stream_broken"
    assert migrations(setup) == {"failed": 1, "exhausted": 1}


def test_a_request_lost_before_its_headers_everywhere_is_answered_with_a_status() -> None:
    # (nothing reached its client: a closed connection would say nothing of why)
    path, body = "/v1/completions", {"model": "m", "prompt": "a b c", "stream": True}
    setup = Setup(tokens=TOKENS, decodes=2, decode_retries=0)
    for decode in setup.decodes:
        decode.die_after_next(0)  # (no opening on this route: closed before a byte)
    answer = setup.post(path, body).answer()

    assert answer.status == 502, answer.body
    assert b"error" in answer.body


def test_a_continuation_that_failed_is_tried_again_elsewhere() -> None:
    # (cache-aware would send it back to the instance that has its longest prefix)
    setup = Setup(tokens=TOKENS, decodes=3, decode_migrations=2, decode_policy="cache-aware")
    first, failing, last = setup.decodes[1], setup.decodes[2], setup.decodes[0]  # (as it picks)
    first.die_after_next(2)
    failing.crash_next(500, "KV load failed")
    answer = setup.post(CHAT, STREAM).answer()
    assert answer.complete
    assert_same_answer(answer.body, uninterrupted(CHAT, STREAM))
    assert [len(d.requests) for d in (first, failing, last)] == [1, 1, 1]


def test_a_decode_that_breaks_its_answers_is_marked_down_as_any_failed_leg() -> None:
    # (its headers came each time: counted as it answered, its breaks were never counted)
    setup = Setup(tokens=TOKENS, decodes=2, unhealthy_threshold=3)
    broken, _ = setup.decodes
    for _ in range(6):
        broken.die_after_next(1)
    for _ in range(6):
        answer = setup.post(CHAT, STREAM).answer()
        assert answer.complete  # (each moved to the sound one)
    first, _ = setup.proxy.service.backends.decode.instances
    assert (first.url, first.state.value, first.failures) == (broken.url, "down", 3)
    assert len(broken.requests) == 3  # (down: no more of the answers go to it)
    assert "its answer broke off" in (first.last_error or "")


def test_a_sound_answer_starts_the_count_again() -> None:
    setup = Setup(tokens=TOKENS, decodes=1, decode_migrations=0, unhealthy_threshold=2)
    (decode,) = setup.decodes
    decode.die_after_next(1)
    setup.post(CHAT, STREAM).answer()
    assert setup.proxy.service.backends.decode.instances[0].failures == 1
    assert setup.post(CHAT, STREAM).answer().complete
    (instance,) = setup.proxy.service.backends.decode.instances
    assert (instance.state.value, instance.failures) == ("up", 0)


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_stream_that_ends_without_its_last_event_is_broken_never_whole(
    path: str, access_events: list[dict[str, Any]]
) -> None:
    setup = Setup(tokens=TOKENS, decode_migrations=0)
    setup.decode.end_after_next(2)  # (its body ends whole, short of [DONE] or its like)
    client = setup.post(path, STREAMS[path])
    answer = client.answer()

    assert not answer.complete and client.lost
    said = answer.body[answer.body.rstrip(b"\n").rfind(b"\n\n") :]
    assert b"error" in said and b"decode closed the stream early" in said, said
    (event,) = access_events
    assert event["ended"] == "broken"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_that_ends_without_its_last_event_moves(path: str) -> None:
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].end_after_next(2)
    answer = setup.post(path, STREAMS[path]).answer()
    assert answer.complete
    assert_same_answer(answer.body, uninterrupted(path, STREAMS[path]))
    assert len(setup.decodes[1].requests) == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_answer_that_said_another_prompt_is_never_continued_from_it(
    path: str, access_events: list[dict[str, Any]], logged: list[dict[str, Any]]
) -> None:
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].other_prompt_ids_next(2)  # (its prompt ids each one more than asked)
    client = setup.post(path, STREAMS[path])

    assert not client.answer().complete and client.lost
    assert sse_events(client)[-1]["error"]["code"] == "decode_stream_broken"
    assert setup.decodes[1].requests == []  # (its prompt was never sent as the request's)
    (event,) = access_events
    assert event["migration"] == "refused (prompt_mismatch)"
    assert migrations(setup) == {"refused": 1}
    warned = [formatEvent(e) for e in logged if e.get("log_level") == LogLevel.warn]
    assert any("other prompt token ids" in line for line in warned), warned


def test_a_continuation_starts_from_the_prompt_prefill_answered() -> None:
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(2)
    answer = setup.post("/v1/completions", STREAMS["/v1/completions"]).answer()
    assert answer.complete
    (prefilled, again) = setup.prefill.requests_for("prefill")
    assert prefilled.body is not None and prefilled.body.get("return_token_ids") is True
    (continued,) = setup.decodes[1].requests_for("decode")
    assert continued.body is not None and again.body is not None
    prompt = prompt_tokens(STREAMS["/v1/completions"])
    assert continued.body["prompt"][: len(prompt)] == prompt
