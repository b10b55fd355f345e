"""The prompt length the decide rules compare with their thresholds."""

from __future__ import annotations

from typing import Any

import pytest

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.prompts import BYTES_PER_TOKEN, estimate_tokens


def test_a_token_id_prompt_is_counted_exactly() -> None:
    assert estimate_tokens(routes.COMPLETIONS, {"prompt": [5, 6, 7, 8, 9]}) == 5


def test_text_is_its_utf8_bytes_over_the_factor_rounded_up() -> None:
    assert BYTES_PER_TOKEN == 4
    assert estimate_tokens(routes.COMPLETIONS, {"prompt": "abcdefghi"}) == 3
    # Three bytes a character: CJK text estimates at about a token a character.
    assert estimate_tokens(routes.COMPLETIONS, {"prompt": "日本語です"}) == 4


@pytest.mark.parametrize(
    ("path", "body", "tokens"),
    [
        (
            routes.CHAT_COMPLETIONS,
            {
                "model": "a-very-long-model-name-that-is-not-the-prompt",
                "messages": [
                    {"role": "system", "content": "abcd" * 10},
                    {"role": "user", "content": [{"type": "text", "text": "abcd" * 5}]},
                ],
            },
            # the texts, and each message's role and part type (rendered by the template too)
            (40 + 20 + len("system") + len("user") + len("text") + 3) // 4,
        ),
        (
            routes.CHAT_COMPLETIONS,
            {"messages": [{"role": "user", "content": "abcd"}], "tools": [{"name": "abcd" * 4}]},
            (4 + 4 + 16) // 4,
        ),
        (routes.RESPONSES, {"input": "abcd" * 3, "instructions": "abcd"}, 4),
        (routes.MESSAGES, {"system": "abcd", "messages": [{"role": "user", "content": "abcd"}]}, 3),
    ],
)
def test_each_route_counts_the_fields_its_template_renders(
    path: str, body: dict[str, Any], tokens: int
) -> None:
    assert estimate_tokens(path, body) == tokens


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (routes.COMPLETIONS, {"model": "m"}),
        (routes.COMPLETIONS, {"prompt": ""}),
        (routes.COMPLETIONS, {"prompt": []}),
        (routes.CHAT_COMPLETIONS, {"messages": []}),
        (routes.RESPONSES, {"input": None}),
        (routes.RESPONSES, {"input": "hi", "previous_response_id": "resp_1"}),
        (routes.RESPONSES, {"input": "hi", "conversation": "conv_1"}),
        (
            routes.CHAT_COMPLETIONS,
            {
                "messages": [
                    {"role": "system", "content": "abcd"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
                        ],
                    },
                ]
            },
        ),
        (
            routes.RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        ),
    ],
)
def test_a_prompt_the_proxy_cannot_measure_has_no_estimate_so_takes_two_legs(
    path: str, body: dict[str, Any]
) -> None:
    assert estimate_tokens(path, body) is None


def test_a_body_nested_as_deep_as_json_allows_is_walked_without_recursion() -> None:
    nested: Any = "abcd"
    for _ in range(100_000):
        nested = [nested]
    assert estimate_tokens(routes.CHAT_COMPLETIONS, {"messages": nested}) == 1
