"""What a client has of an answer that may move (``protocol.transcript``, ``protocol.held``),
on vLLM's own bytes: whole events, their token ids kept and shown as vLLM shows them when not
asked, a continuation's events made the answer's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nixl_twisted.protocol.held import MAX_HELD, Opening, Whole
from nixl_twisted.protocol.resumable import MAX_RELAYED_TOKENS
from nixl_twisted.protocol.transcript import Transcript, is_error


def chunk(ids: list[int] | None, text: str = "x", finish: str | None = None, **top: Any) -> bytes:
    """A chat chunk as vLLM 0.32 writes it (pydantic, compact, ``exclude_unset``)."""
    choice = {
        "index": 0,
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": finish,
        "token_ids": ids,
    }
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 100, "model": "m"}
    event.update(top, choices=[choice])
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def opening(prompt: list[int] | None, answer: str = "chatcmpl-1", created: int = 100) -> bytes:
    event = {
        "id": answer,
        "object": "chat.completion.chunk",
        "created": created,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ],
        "prompt_token_ids": prompt,
    }
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


USAGE = (
    b'data: {"id":"chatcmpl-2","object":"chat.completion.chunk","created":200,"model":"m",'
    b'"choices":[],"usage":{"prompt_tokens":7,"total_tokens":10,"completion_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens":6}}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def test_the_ids_are_kept_and_shown_as_null_when_the_client_did_not_ask() -> None:
    transcript = Transcript(chat=True, strip=True)
    passed = transcript(opening([1, 2, 3]) + chunk([7], "a") + chunk([8], "b"))
    assert passed == opening(None) + chunk(None, "a") + chunk(None, "b")
    assert transcript.continuation([1, 2, 3]) == ([1, 2, 3, 7, 8], 2)


def test_a_client_that_asked_gets_them_as_they_came() -> None:
    transcript = Transcript(chat=True, strip=False)
    sent = opening([1, 2]) + chunk([7], "a")
    assert transcript(sent) == sent
    assert transcript.continuation([1, 2]) == ([1, 2, 7], 1)


def test_an_event_split_across_reads_passes_whole_once_it_ends() -> None:
    transcript = Transcript(chat=True, strip=True)
    sent = opening([1]) + chunk([7, 8], "ab")
    passed = [transcript(sent[i : i + 5]) for i in range(0, len(sent), 5)]
    assert b"".join(passed) == opening(None) + chunk(None, "ab")
    assert all(p.endswith(b"\n\n") for p in passed if p)
    cut = chunk([9], "c")
    assert transcript(cut[:-3]) == b""  # cut short: never passed
    assert transcript.continuation([1]) == ([1, 7, 8], 2)


def test_an_empty_chunk_sent_only_to_carry_ids_is_not_passed() -> None:
    """With a parser, vLLM sends a text-less token only when its ids were asked."""
    transcript = Transcript(chat=True, strip=True)
    empty = chunk([9], "").replace(b'"delta":{"content":""}', b'"delta":{}')
    assert transcript(opening([1]) + empty + chunk([10], "é")) == opening(None) + chunk(None, "é")
    assert transcript.continuation([1]) == ([1, 9, 10], 2)
    assert transcript(empty.replace(b"[9]", b"[11]")) == b""
    assert transcript.continuation([1]) == "mid_character"  # (the last token said nothing)


def test_a_stream_moves_after_its_opening_alone() -> None:
    transcript = Transcript(chat=True, strip=True)
    transcript(opening([1, 2]))
    assert transcript.continuation([1, 2]) == ([1, 2], 0)


def test_an_error_event_is_caught_with_what_follows() -> None:
    transcript = Transcript(chat=True, strip=True)
    error = b'data: {"error": {"message": "KV load failed", "code": 500}}\n\n'
    assert transcript(opening([1]) + chunk([7]) + error + DONE) == opening(None) + chunk(None)
    assert transcript.error == error + DONE and is_error(error)
    assert transcript.continuation([1]) == ([1, 7], 1)


@pytest.mark.parametrize(
    ("events", "why"),
    [
        (opening([1]) + chunk(None), "no_token_ids"),  # (a server that hides them)
        (opening([2]) + chunk([7]), "prompt_mismatch"),  # (it answered another prompt)
        (opening([1]) + chunk([7], finish="stop"), "finished"),
        (opening([1]) + chunk([7]) + USAGE, "finished"),
        (opening([1]) + chunk([7]) + DONE, "finished"),
        # (vLLM 0.32's detokenizer, on real vLLM: a prompt that ends inside a character
        # makes a continuation write the prompt's text first)
        (opening([1]) + chunk([7], "a") + chunk([8], ""), "mid_character"),
        (opening([1]) + chunk([7]).replace(b'"content"', b'"reasoning"'), "reasoning"),
    ],
)
def test_what_no_continuation_would_answer_alike_is_said(events: bytes, why: str) -> None:
    transcript = Transcript(chat=True, strip=True)
    transcript(events)
    assert transcript.continuation([1]) == why


def test_the_continuation_is_the_requests_own_prompt_never_the_answers() -> None:
    transcript = Transcript(chat=True, strip=True)
    transcript(opening(None) + chunk([7]))  # (decode said no prompt ids: the request's hold)
    assert transcript.continuation([1, 2]) == ([1, 2, 7], 1)
    assert transcript.continuation(None) == "no_token_ids"  # (unknown: nothing to send)
    answered = Transcript(chat=True, strip=True)
    answered(opening([5, 6]) + chunk([7]))
    assert answered.continuation(None) == "no_token_ids"  # (never what decode said)
    assert answered.continuation([1, 2]) == "prompt_mismatch"


def test_past_the_length_the_ids_are_let_go() -> None:
    transcript = Transcript(chat=True, strip=True)
    transcript(opening([1]) + chunk(list(range(MAX_RELAYED_TOKENS)), "x"))
    assert transcript.continuation([1]) == ([1, *range(MAX_RELAYED_TOKENS)], MAX_RELAYED_TOKENS)
    assert transcript(chunk([5])) == chunk(None)
    assert transcript.continuation([1]) == "too_long"


def test_a_stream_past_the_length_keeps_no_ids() -> None:
    # (what bounds the memory: each token's ids let go once past the bound, not kept)
    transcript = Transcript(chat=True, strip=True)
    transcript(opening([1]))
    for token in range(MAX_RELAYED_TOKENS + 1):
        transcript(chunk([token]))
    assert transcript.inexact == "too_long" and transcript.tokens == 0


def test_a_continuations_events_are_the_answers() -> None:
    transcript = Transcript(chat=True, strip=True)
    transcript(opening([1, 2]) + chunk([7], "a"))
    transcript.resume(cached=1)
    again = opening([1, 2, 7], "chatcmpl-2", 200)
    later = chunk([8], "b").replace(b"chatcmpl-1", b"chatcmpl-2").replace(b":100", b":200")
    passed = transcript(again + later + USAGE + DONE)
    usage = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":100,"model":"m",'
        b'"choices":[],"usage":{"prompt_tokens":6,"total_tokens":10,"completion_tokens":4,'
        b'"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
    )
    assert passed == chunk(None, "b") + usage + DONE
    assert transcript.continuation([1, 2]) == "finished"


def test_a_text_completions_continuation_loses_its_prompts_ids() -> None:
    def text(ids: list[int], prompt: list[int] | None, answer: str = "cmpl-1") -> bytes:
        choice = {"index": 0, "text": "t", "prompt_token_ids": prompt, "token_ids": ids}
        event = {"id": answer, "object": "text_completion", "created": 5, "choices": [choice]}
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    transcript = Transcript(chat=False, strip=False)
    assert transcript(text([7], [1, 2])) == text([7], [1, 2])
    assert transcript.continuation([1, 2]) == ([1, 2, 7], 1)
    transcript.resume()
    assert transcript(text([8], [1, 2, 7], "cmpl-2")) == text([8], None)


RESPONSE_OPENING = (
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
    b'"response":{"id":"resp_1","created_at":10,"status":"in_progress"}}\n\n'
    b'event: response.output_item.added\ndata: {"type":"response.output_item.added",'
    b'"sequence_number":1,"item":{"id":"msg_1","status":"in_progress"}}\n\n'
)
DELTA = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"sequence_number":2,"item_id":"msg_1","delta":"Hi"}\n\n'
)


def test_a_streams_opening_sent_again_is_the_firsts() -> None:
    first = Opening()
    assert first(RESPONSE_OPENING) == RESPONSE_OPENING
    assert first.passed and not first.tokens
    again = Opening(first.opening)
    other = RESPONSE_OPENING.replace(b"resp_1", b"resp_2").replace(b"msg_1", b"msg_2")
    other = other.replace(b'"created_at":10', b'"created_at":11')
    assert again(other) == b""  # (its own opening: the client has the first's)
    assert again(DELTA.replace(b"msg_1", b"msg_2")) == DELTA
    assert again.tokens


def test_a_stream_past_its_first_token_is_no_longer_looked_at() -> None:
    opening_ = Opening()
    assert opening_(RESPONSE_OPENING + DELTA) == RESPONSE_OPENING + DELTA
    assert opening_.tokens and opening_.done


def test_an_error_before_the_first_token_is_caught() -> None:
    error = b'event: error\ndata: {"type":"error","error":{"message":"x"}}\n\n'
    opening_ = Opening()
    assert opening_(error) == b"" and opening_.error == error and not opening_.passed


def test_a_whole_answer_is_held_until_it_ends() -> None:
    whole = Whole()
    assert whole(b'{"id": ') == b"" and whole(b'"x"}') == b""
    assert not whole.passed and whole.rest() == b'{"id": "x"}'
    big = Whole()
    assert big(b"x" * (MAX_HELD + 1)) == b"x" * (MAX_HELD + 1) and big.passed


def test_past_the_opening_whole_chunks_of_several_events_pass_alike() -> None:
    transcript = Transcript(chat=True, strip=True)
    transcript(opening([1]))
    transcript(chunk([7], "a"))  # (its ids seen: the steady path from here)
    assert transcript(chunk([8], "b") + chunk([9, 10], "cd")) == chunk(None, "b") + chunk(
        None, "cd"
    )
    cut = chunk([11], "e")
    assert transcript(cut[:9]) == b"" and transcript(cut[9:]) == chunk(None, "e")
    assert transcript.continuation([1]) == ([1, 7, 8, 9, 10, 11], 5)
    reasoned = chunk([12], "g").replace(b'"content"', b'"reasoning"')
    assert transcript(reasoned) == chunk(None, "g").replace(b'"content"', b'"reasoning"')
    assert transcript.continuation([1]) == "reasoning"


def test_an_error_after_the_opening_holds_what_follows() -> None:
    transcript = Transcript(chat=True, strip=False)
    transcript(opening([1]) + chunk([7]))
    error = b'data: {"error": {"message": "x", "code": 500}}\n\n'
    assert transcript(chunk([8]) + error) == chunk([8])
    assert transcript(DONE) == b"" and transcript.error == error + DONE
    assert transcript.continuation([1]) == ([1, 7, 8], 2)
