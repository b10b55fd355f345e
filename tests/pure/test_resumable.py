"""What a migration may continue, and the body of a continuation (``protocol.resumable``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.resumable import (
    COMPLETIONS_MAX_TOKENS,
    continued_body,
    resumable,
    spent,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("asked", "refused", "from_start"),
    [
        ({}, None, None),
        ({"n": 1, "best_of": None, "temperature": 0.7, "top_p": 0.9}, None, None),
        ({"logprobs": True, "top_logprobs": 2, "repetition_penalty": 1.1}, None, None),
        ({"seed": 3, "temperature": 0}, None, None),
        ({"tools": [], "tool_choice": "auto"}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"n": 2}, "n", None),
        ({"best_of": 3}, "n", None),
        ({"use_beam_search": True}, "beam_search", None),
        ({"response_format": {"type": "json_schema"}}, None, "structured_output"),
        ({"structured_outputs": {"regex": "a+"}}, None, "structured_output"),
        ({"tools": [{"type": "function"}]}, None, "tools"),
        ({"seed": 3}, None, "seeded_sampling"),
        ({"stop": "\n"}, None, "stop_strings"),
        ({"echo": True}, None, "echo"),
        ({"prompt_logprobs": 1}, None, "prompt_logprobs"),
        ({"frequency_penalty": 0.3}, None, "penalties"),
        ({"bad_words": ["x"]}, None, "bad_words"),
        ({"truncate_prompt_tokens": 10}, None, "truncation"),
    ],
)
def test_a_chat_stream(asked: dict[str, Any], refused: str | None, from_start: str | None) -> None:
    found = resumable(routes.CHAT_COMPLETIONS, dict(CHAT, **asked), stream=True)
    assert (found.refused, found.from_start) == (refused, from_start)
    assert found.tracked == (refused is None and from_start is None)


def test_where_no_token_ids_are_known_only_before_the_first_token() -> None:
    for path in (routes.RESPONSES, routes.MESSAGES):
        assert resumable(path, CHAT, stream=True).from_start == "no_token_ids"
    assert resumable(routes.CHAT_COMPLETIONS, CHAT, stream=False).from_start == "whole"
    text = {"model": "m", "prompt": "x", "logprobs": 1}
    assert resumable(routes.COMPLETIONS, text, stream=True).from_start == "logprobs_offsets"


def test_a_chats_continuation_keeps_its_messages_and_loses_what_was_generated() -> None:
    body = dict(CHAT, max_tokens=10, max_completion_tokens=8, min_tokens=5)
    continued = continued_body(routes.CHAT_COMPLETIONS, body, [1, 2, 3], 3)
    assert continued == dict(CHAT, max_tokens=7, max_completion_tokens=5, min_tokens=2)
    # No limit named: vLLM's own, the context left, shrinks by the same tokens.
    assert continued_body(routes.CHAT_COMPLETIONS, CHAT, [1], 4) == CHAT


def test_a_text_completions_continuation_is_its_ids() -> None:
    body = {"model": "m", "prompt": "the quick", "min_tokens": 2}
    continued = continued_body(routes.COMPLETIONS, body, [1, 2, 9], 1)
    assert continued == {
        "model": "m",
        "prompt": [1, 2, 9],
        "max_tokens": COMPLETIONS_MAX_TOKENS - 1,
        "min_tokens": 1,
    }
    unbounded = continued_body(routes.COMPLETIONS, dict(body, max_tokens=None), [1], 1)
    assert unbounded["max_tokens"] is None


def test_a_continued_chat_hands_its_ids_on_both_legs() -> None:
    completion = Completion(routes.CHAT_COMPLETIONS, dict(CHAT, stream=True), "r1")
    continued = completion.continued([5, 6, 7], 1)
    assert continued.resumed == (5, 6, 7) and not continued.hands_token_ids
    prefill = json.loads(continued.prefill_bytes())
    assert prefill["kv_transfer_params"]["prompt_token_ids"] == [5, 6, 7]
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    decode = json.loads(continued.decode_bytes({"remote_engine_id": "e"}, True))
    assert decode["kv_transfer_params"] == {"remote_engine_id": "e", "prompt_token_ids": [5, 6, 7]}
    assert decode["return_token_ids"] is True
    alone = json.loads(continued.decode_only_bytes())
    assert alone["kv_transfer_params"] == {"prompt_token_ids": [5, 6, 7]}
    assert "return_token_ids" not in alone


def test_a_continuation_that_would_ask_for_no_token_is_never_made() -> None:
    # (vLLM answers a max_tokens of 0 with a 400: the answer ends as without migrations)
    chat, text = routes.CHAT_COMPLETIONS, routes.COMPLETIONS
    assert spent(chat, {"max_tokens": 3}, 3)
    assert spent(chat, {"max_completion_tokens": 3}, 3)
    assert not spent(chat, {"max_tokens": 4}, 3)
    assert not spent(chat, {}, 10_000)  # (vLLM's own limit: the context left)
    assert spent(text, {}, COMPLETIONS_MAX_TOKENS)  # (absent is vLLM's 16)
    assert not spent(text, {"max_tokens": None}, 10_000)  # (null is no limit)
