"""The usage an answer reports, read from the tail of decode's body in each API's words."""

from __future__ import annotations

import json

import pytest

from nixl_twisted.protocol.usage import TAIL, Usage, read_usage

CHAT = {
    "id": "c",
    "choices": [{"index": 0, "message": {"content": "hi"}}],
    "usage": {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 8},
    },
    "kv_transfer_params": None,
}


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        (json.dumps(CHAT).encode(), Usage(12, 3, 8)),
        (  # a stream: the usage chunk, then [DONE]; earlier chunks carry "usage": null
            b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
            b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\n'
            b"data: [DONE]\n\n",
            Usage(4, 2, None),
        ),
        (  # Anthropic's message_delta, after message_start's
            b'event: message_start\ndata: {"message": {"usage": {"input_tokens": 9}}}\n\n'
            b'event: message_delta\ndata: {"delta": {}, "usage": {"output_tokens": 5, '
            b'"cache_read_input_tokens": 2}}\n\nevent: message_stop\ndata: {}\n\n',
            Usage(None, 5, 2),
        ),
        (  # the Responses API's names
            b'{"output": [], "usage": {"input_tokens": 7, "output_tokens": 1, '
            b'"input_tokens_details": {"cached_tokens": 0}}}',
            Usage(7, 1, 0),
        ),
        (b'{"choices": []}', None),
        (b'{"usage": {"prompt_tokens": 4, "compl', None),  # cut off
        (b'{"usage": {"prompt_tokens": true, "completion_tokens": "2"}}', Usage()),
    ],
)
def test_the_last_usage_in_each_apis_words(body: bytes, usage: Usage | None) -> None:
    assert read_usage(body) == usage


def test_only_the_last_bytes_are_read() -> None:
    usage = b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}'
    assert read_usage(usage + b" " * (TAIL - len(usage))) == Usage(1, 2)
    assert read_usage(usage + b" " * TAIL) is None


def test_a_batchs_usage_is_its_parts_summed() -> None:
    assert Usage(1, 2, None) + Usage(3, None, 4) == Usage(4, 2, 4)
