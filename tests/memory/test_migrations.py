"""A decode instance that fails mid-answer: the answer goes on on another, token for token.

Each route and mode, each way decode fails (its connection cut, an error
event, silence, the instance marked down): the client's answer is the one
an uninterrupted run gives, byte for byte but for the answer's own id and
time, one ``[DONE]``, the usage of the whole answer (``failures.md``,
"Decode migrations").
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from nixl_twisted.testing.answers import generated_ids
from nixl_twisted.testing.prefix_cache import prompt_tokens
from tests.memory.migrations import (
    OPENING,
    STREAMS,
    TOKENS,
    TRACKED,
    assert_same_answer,
    done_count,
    uninterrupted,
    whole,
)
from tests.memory.support import TIMEOUTS, Setup, sse_payloads


@pytest.mark.parametrize("path", TRACKED)
@pytest.mark.parametrize("tokens", [0, 1, 4])
def test_a_stream_whose_decode_dies_after_k_tokens_goes_on_elsewhere(
    path: str, tokens: int
) -> None:
    body = STREAMS[path]
    setup = Setup(tokens=TOKENS, decodes=2)
    first, second = setup.decodes
    first.die_after_next(tokens)
    answer = setup.post(path, body).answer()

    assert answer.status == 200 and answer.complete
    assert_same_answer(answer.body, uninterrupted(path, body))
    assert done_count(answer.body) == 1
    # The rest asked of the other instance: the prompt and the tokens relayed as ids, and
    # what was left to generate.
    (moved,) = second.requests_for("decode")
    assert moved.body is not None and moved.body["return_token_ids"] is True
    relayed = generated_ids(0, tokens)
    prompt = prompt_tokens(body)
    if path == "/v1/completions" and not tokens:  # (nothing reached the client: the request)
        assert moved.body["prompt"] == body["prompt"]
    elif path == "/v1/completions":
        assert (moved.body["prompt"], moved.body["max_tokens"]) == (prompt + relayed, 16 - tokens)
    else:
        assert moved.handed_token_ids == prompt + relayed
        assert moved.body["messages"] == body["messages"]


@pytest.mark.parametrize("path", TRACKED)
def test_an_error_event_mid_stream_goes_on_elsewhere(path: str) -> None:
    body = STREAMS[path]
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].fail_after_next(3)
    answer = setup.post(path, body).answer()

    assert_same_answer(answer.body, uninterrupted(path, body))
    assert b'"error"' not in answer.body and done_count(answer.body) == 1


@pytest.mark.parametrize("path", TRACKED)
def test_a_stream_silent_past_the_idle_timeout_goes_on_elsewhere(path: str) -> None:
    body = STREAMS[path]
    setup = Setup(tokens=TOKENS, decodes=2)
    first = setup.decodes[0]
    client = setup.held_stream(first, after=OPENING[path] + 2, path=path, body=body)
    setup.proxy.advance(TIMEOUTS.stream_idle)
    answer = client.answer()

    assert answer.complete
    assert_same_answer(answer.body, uninterrupted(path, body))
    assert first.disconnects == 1  # its stream closed: vLLM aborts it
    first.release()


def test_a_stream_whose_instance_is_marked_down_goes_on_elsewhere_at_once() -> None:
    path, body = "/v1/chat/completions", STREAMS["/v1/chat/completions"]
    setup = Setup(tokens=TOKENS, decodes=2, health_interval=3, unhealthy_threshold=1)
    first = setup.decodes[0]
    client = setup.held_stream(first, after=3, path=path, body=body)
    first.health_status = 503  # its engine is gone; the stream is still open
    setup.proxy.advance(3)
    answer = client.answer()

    assert answer.complete  # moved at the check's verdict, long before the idle timeout
    assert_same_answer(answer.body, uninterrupted(path, body))
    first.release()


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_typed_stream_broken_before_its_first_token_is_sent_again(path: str) -> None:
    """No token ids on these routes: the request itself again, its opening the first's."""
    body = STREAMS[path]
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(0)
    answer = setup.post(path, body).answer()

    assert answer.complete
    assert_same_answer(answer.body, uninterrupted(path, body))
    # The request again, after a prefill of its own (the first one's KV may be gone).
    first, again = setup.decodes[0].requests[0], setup.decodes[1].requests_for("decode")[0]
    assert again.body is not None and first.body is not None
    assert {**again.body, "kv_transfer_params": None} == {**first.body, "kv_transfer_params": None}
    assert len(setup.prefill.requests) == 2


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_typed_stream_broken_after_its_first_token_ends_as_it_did(
    path: str, access_events: list[dict[str, Any]]
) -> None:
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(2)
    client = setup.post(path, STREAMS[path])
    answer = client.answer()

    assert not answer.complete and client.lost
    assert b"decode closed the stream early" in answer.body
    assert setup.decodes[1].requests == []
    (event,) = access_events
    assert event["migration"] == "refused (no_token_ids)"
    assert setup.scrape()[("nixlproxy_migrations_total", (("outcome", "refused"),))] == 1


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_whole_answer_cut_short_is_answered_whole_by_another_instance(path: str) -> None:
    body = whole(path)
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].break_next()  # its JSON closed halfway
    answer = setup.post(path, body).answer()

    assert answer.status == 200 and answer.complete
    assert json.loads(answer.body)  # (nothing of the cut answer reached the client)
    assert_same_answer(answer.body, uninterrupted(path, body))


def test_a_client_that_asked_for_token_ids_gets_the_whole_answers() -> None:
    path = "/v1/chat/completions"
    body = dict(STREAMS[path], return_token_ids=True)
    setup = Setup(tokens=TOKENS, decodes=2)
    setup.decodes[0].die_after_next(2)
    answer = setup.post(path, body).answer()

    assert_same_answer(answer.body, uninterrupted(path, body))
    chunks = [e for e in sse_payloads(answer.body) if isinstance(e, dict)]
    ids = [
        i for chunk in chunks for choice in chunk["choices"] for i in choice.get("token_ids") or []
    ]
    assert len(ids) == TOKENS and ids == sorted(set(ids))
    assert chunks[0]["prompt_token_ids"] and all("prompt_token_ids" not in c for c in chunks[1:])


def test_a_decode_lost_before_its_headers_is_sent_again_with_a_prefill_of_its_own() -> None:
    """It may have pulled prefill's KV (which prefill then frees): its params never go again."""
    path, body = "/v1/completions", STREAMS["/v1/completions"]
    setup = Setup(tokens=TOKENS, decodes=2)
    first, second = setup.decodes
    first.die_after_next(0)  # (no opening on this route: the connection closes before a byte)
    answer = setup.post(path, body).answer()

    assert answer.status == 200 and answer.complete
    assert_same_answer(answer.body, uninterrupted(path, body))
    assert len(setup.prefill.requests) == 2
    lost, again = first.requests[0], second.requests[0]
    assert lost.connector_params != again.connector_params
    # The first decode had pulled its KV: the same params again would fail to load.
    assert setup.ledger.redeemed == [lost.connector_params, again.connector_params]


def test_a_stream_kept_alive_moves_with_its_frames_before_it() -> None:
    path, body = "/v1/chat/completions", STREAMS["/v1/chat/completions"]
    setup = Setup(tokens=TOKENS, decodes=2, sse_keepalive=5)
    first = setup.decodes[0]
    first.hold_answers()
    held = first.stream_held()
    client = setup.post(path, body)
    assert held.called
    setup.proxy.advance(5)  # one frame: the client has its 200
    assert client.received().count(b": keep-alive") == 1
    first.die_after_next(2)
    first.release()
    setup.proxy.flush()
    answer = client.answer()
    assert answer.complete
    frames = answer.body.split(b"\n\n", 1)
    assert frames[0] == b": keep-alive"
    assert_same_answer(frames[1], uninterrupted(path, body))
