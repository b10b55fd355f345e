"""Decode's handle taken out of its answer, and the ids it covers read on the way."""

from __future__ import annotations

import json

import pytest

from nixl_twisted.protocol.decode_handle import HandleTaker, cut_handle

HANDLE = {"do_remote_decode": True, "remote_block_ids": [[1, 2], [3]], "remote_num_tokens": 9}


def _whole(**extra: object) -> bytes:
    body: dict[str, object] = {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "message": {"content": "hi"}}],
    }
    body.update(extra)
    return json.dumps(body, separators=(",", ":")).encode()


def test_the_handle_is_cut_out_wherever_it_is_and_the_rest_is_byte_for_byte_decodes() -> None:
    last = _whole(usage={"prompt_tokens": 3}, kv_transfer_params=HANDLE)
    first = b'{"kv_transfer_params":' + json.dumps(HANDLE).encode() + b', "id": "x"}'
    inner = b'data: {"type":"response.completed","response":{"id":"r","kv_transfer_params":'
    inner += json.dumps(HANDLE).encode() + b',"status":"completed"}}\n\n'
    assert cut_handle(last) == (_whole(usage={"prompt_tokens": 3}), HANDLE)
    assert cut_handle(first) == (b'{ "id": "x"}', HANDLE)
    cut, taken = cut_handle(inner)
    assert taken == HANDLE
    completed = b'data: {"type":"response.completed","response":{"id":"r","status":"completed"}}'
    assert cut == completed + b"\n\n"


def test_a_null_handle_is_left_as_vllm_sent_it() -> None:
    body = _whole(kv_transfer_params=None)
    assert cut_handle(body) == (body, None)


def test_a_whole_answer_is_held_and_its_length_made_what_is_sent() -> None:
    lengths: list[int | None] = []
    taker = HandleTaker(False, lengths.append)
    body = _whole(kv_transfer_params=HANDLE)
    assert taker(body[:10]) == b"" and taker(body[10:]) == b""
    sent = taker.rest()
    assert json.loads(sent) == json.loads(_whole())
    assert lengths == [len(sent)] and taker.handle == HANDLE


def test_an_answer_without_a_handle_keeps_its_length() -> None:
    lengths: list[int | None] = []
    taker = HandleTaker(False, lengths.append)
    body = _whole()
    taker(body)
    assert taker.rest() == body and lengths == [] and taker.handle is None


def test_a_whole_answers_ids_are_read_and_shown_as_null_when_the_client_did_not_ask() -> None:
    taker = HandleTaker(False, lambda length: None, collect=True, strip_ids=True)
    body = {
        "choices": [{"index": 0, "message": {"content": "ab"}, "token_ids": [7, 8]}],
        "prompt_token_ids": [1, 2, 3],
        "kv_transfer_params": HANDLE,
    }
    taker(json.dumps(body).encode())
    sent = json.loads(taker.rest())
    assert taker.tokens == [1, 2, 3, 7, 8]
    assert sent == {
        "choices": [{"index": 0, "message": {"content": "ab"}, "token_ids": None}],
        "prompt_token_ids": None,
    }


def test_a_text_completions_prompt_ids_are_in_its_choice() -> None:
    taker = HandleTaker(False, lambda length: None, collect=True)
    body = {"choices": [{"text": "ab", "prompt_token_ids": [1, 2], "token_ids": [5]}]}
    taker(json.dumps(body).encode())
    taker.rest()
    assert taker.tokens == [1, 2, 5]


def test_a_stream_passes_event_by_event_and_its_last_chunks_handle_is_taken() -> None:
    taker = HandleTaker(True, lambda length: None, collect=True, strip_ids=True, chat=True)
    opening = b'data: {"choices":[{"delta":{"role":"assistant"}}],"prompt_token_ids":[1,2]}\n\n'
    token = b'data: {"choices":[{"delta":{"content":"a"},"token_ids":[9]}]}\n\n'
    last = (
        b'data: {"choices":[{"delta":{"content":"b"},"token_ids":[10],"finish_reason":"stop"}],'
        b'"kv_transfer_params":' + json.dumps(HANDLE).encode() + b"}\n\ndata: [DONE]\n\n"
    )
    passed = taker(opening) + taker(token[:20]) + taker(token[20:]) + taker(last)
    assert b"kv_transfer_params" not in passed and b"[9]" not in passed
    assert b'"prompt_token_ids":null' in passed and passed.endswith(b"data: [DONE]\n\n")
    assert taker.handle == HANDLE and taker.tokens == [1, 2, 9, 10]


def test_a_stream_with_nothing_to_take_passes_as_it_came() -> None:
    taker = HandleTaker(True, lambda length: None)
    event = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    assert taker(event) is event


def test_only_the_last_object_so_named_is_decodes_a_tools_schema_before_it_is_the_clients() -> None:
    schema = {"type": "object", "properties": {"kv_transfer_params": {"type": "object"}}}
    body = _whole(tools=[{"parameters": schema}], kv_transfer_params=HANDLE)
    cut, taken = cut_handle(body)
    assert taken == HANDLE and json.loads(cut) == json.loads(_whole(tools=[{"parameters": schema}]))


def test_past_the_bound_a_list_of_ids_is_never_split_and_passed_unseen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nixl_twisted.protocol import decode_handle

    monkeypatch.setattr(decode_handle, "MAX_HELD", 64)
    monkeypatch.setattr(decode_handle, "TAIL", 24)
    lengths: list[int | None] = []
    taker = HandleTaker(False, lengths.append, strip_ids=True)
    body = b'{"logprobs":"' + b"x" * 40 + b'","token_ids":[1,2,3,4,5,6,7,8,9,10,11,12],"a":1}'
    sent = b"".join(taker(body[i : i + 8]) for i in range(0, len(body), 8)) + taker.rest()
    assert lengths == [None]  # (past the bound: no length)
    assert json.loads(sent)["token_ids"] is None
