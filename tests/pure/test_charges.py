"""What a request is charged against its tenant's tokens per minute until vLLM says."""

from __future__ import annotations

from typing import Any

import pytest

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.charges import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    UNKNOWN_CONTEXT_COMPLETION_TOKENS,
    completion_bound,
)
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.prompts import MEDIA_PART_TOKENS, measure


def charge(path: str, body: dict[str, Any], context: int | None) -> int:
    """What a completion of ``body`` on ``path`` is charged (``Completion.charge``)."""
    return Completion(path, body, "r").charge(context)


HI = [{"role": "user", "content": "abcdefgh"}]  # (8 bytes: 2 tokens, and the role's 1)


def test_a_batch_is_each_prompt_times_n_times_max_tokens() -> None:
    one = {"prompt": [1, 2, 3, 4], "max_tokens": 10}
    assert charge(routes.COMPLETIONS, one, None) == 4 + 10
    batch = {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 10, "n": 2}
    assert charge(routes.COMPLETIONS, batch, None) == 5 + 2 * 2 * 10
    chat = {"messages": HI, "max_tokens": 7, "n": 3}
    assert charge(routes.CHAT_COMPLETIONS, chat, None) == 3 + 3 * 7
    best = {"prompt": [1, 2], "max_tokens": 10, "n": 2, "best_of": 5}  # (5 generated, 2 kept)
    assert charge(routes.COMPLETIONS, best, None) == 2 + 5 * 10


@pytest.mark.parametrize(
    ("path", "body", "bound"),
    [
        (routes.CHAT_COMPLETIONS, {"max_completion_tokens": 5, "max_tokens": 9}, 5),
        (
            routes.CHAT_COMPLETIONS,
            {"max_completion_tokens": 0, "max_tokens": 9},
            9,
        ),  # (vLLM's `or`)
        (routes.CHAT_COMPLETIONS, {"max_output_tokens": 5}, None),  # (not chat's: ignored)
        (routes.RESPONSES, {"max_output_tokens": 5}, 5),
        (routes.RESPONSES, {"max_tokens": 5}, None),
        (routes.MESSAGES, {"max_tokens": 5}, 5),
        (routes.COMPLETIONS, {}, COMPLETIONS_DEFAULT_MAX_TOKENS),  # (vLLM's default)
        (routes.COMPLETIONS, {"max_tokens": None}, None),  # (null: up to the context)
        (routes.CHAT_COMPLETIONS, {"max_tokens": True}, None),
        (routes.CHAT_COMPLETIONS, {"max_tokens": "5"}, None),
        (routes.CHAT_COMPLETIONS, {"max_tokens": -1}, None),
    ],
)
def test_each_route_is_bounded_by_its_own_field(
    path: str, body: dict[str, Any], bound: int | None
) -> None:
    assert completion_bound(path, body) == bound


def test_without_a_bound_a_request_is_charged_the_whole_context() -> None:
    chat = {"messages": HI}
    assert charge(routes.CHAT_COMPLETIONS, chat, 4096) == 4096  # its prompt, and the rest
    assert charge(routes.CHAT_COMPLETIONS, dict(chat, n=2), 4096) == 3 + 2 * (4096 - 3)
    assert charge(routes.RESPONSES, {"input": "abcd"}, 1000) == 1000
    assert charge(routes.MESSAGES, {"messages": HI}, 1000) == 1000
    batch = {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": None}
    assert charge(routes.COMPLETIONS, batch, 100) == 200  # (each prompt fills its context)
    # The context unknown: a documented bound per completion.
    assert charge(routes.CHAT_COMPLETIONS, chat, None) == 3 + UNKNOWN_CONTEXT_COMPLETION_TOKENS
    # A bound past the context is held to it (vLLM would refuse it anyway).
    assert charge(routes.CHAT_COMPLETIONS, dict(chat, max_tokens=10**12), 4096) == 3 + 4096


def test_each_media_part_is_charged_a_documented_estimate_not_its_bytes() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40000}}
    audio = {"type": "input_audio", "input_audio": {"data": "A" * 40000, "format": "wav"}}
    content = [{"type": "text", "text": "abcdefgh"}, image, audio]
    chat = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    prompt = measure(routes.CHAT_COMPLETIONS, chat).charged
    assert prompt == 2 * MEDIA_PART_TOKENS + (8 + len("user") + len("text")) // 4
    assert charge(routes.CHAT_COMPLETIONS, chat, None) == prompt + 4
    responses = {
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]
    }
    assert measure(routes.RESPONSES, responses).charged == MEDIA_PART_TOKENS + 1  # ("user")


def test_a_body_without_a_prompt_is_charged_its_completions() -> None:
    assert measure(routes.CHAT_COMPLETIONS, {"model": "m"}).charged == 0
    assert charge(routes.CHAT_COMPLETIONS, {"max_tokens": 3}, None) == 3
