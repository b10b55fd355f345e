"""The usage an answer reports, read from the tail of decode's body in each API's words."""

from __future__ import annotations

import json

import pytest

from nixl_twisted.protocol.lowering import usage_asked
from nixl_twisted.protocol.usage import TAIL, Usage, UsageChunkHidden, read_usage

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


STREAM = [
    b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n',
    b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\n',
    b"data: [DONE]\n\n",
]


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_the_usage_chunk_is_taken_out_however_the_stream_is_cut(size: int) -> None:
    raw = b"".join(STREAM)
    hidden = UsageChunkHidden()
    passed = b"".join(hidden(raw[at : at + size]) for at in range(0, len(raw), size))
    assert passed + hidden.rest() == STREAM[0] + STREAM[1] + STREAM[3]


def test_a_chunk_with_choices_and_usage_passes_and_a_cut_event_comes_out_at_the_end() -> None:
    hidden = UsageChunkHidden()
    both = b'data: {"choices": [{"index": 0}], "usage": {"prompt_tokens": 1}}\n\n'
    assert hidden(both + b'data: {"cho') == both
    assert hidden.rest() == b'data: {"cho'


def test_usage_is_asked_of_an_openai_stream_that_did_not_ask() -> None:
    chat = {"messages": [], "stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert usage_asked("/v1/chat/completions", chat) == dict(
        chat, stream_options={"include_usage": True, "continuous_usage_stats": False}
    )
    assert usage_asked("/v1/completions", {"prompt": "a", "stream": True}) == {
        "prompt": "a",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert usage_asked("/v1/chat/completions", asked) is None  # (asked already)
    assert usage_asked("/v1/chat/completions", {"stream": False}) is None
    assert usage_asked("/v1/chat/completions", {"stream": True, "stream_options": 3}) is None
    # Responses and Messages streams carry their usage in their last event.
    assert usage_asked("/v1/responses", {"stream": True}) is None
    assert usage_asked("/v1/messages", {"stream": True}) is None
