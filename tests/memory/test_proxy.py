"""The two legs end to end in memory: what each leg carries, streams, rotation."""

from __future__ import annotations

from nixl_twisted.protocol.lowering import prefill_kv_transfer_params
from tests.memory.support import FULL_CHAT, Setup, sse_events

# -- the two legs --------------------------------------------------------------


def test_chat_goes_through_prefill_then_decode() -> None:
    setup = Setup()
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()

    assert answer.status == 200
    assert answer.json()["object"] == "chat.completion"
    assert answer.json()["choices"][0]["message"]["content"]
    (prefill,) = setup.prefill.requests
    (decode,) = setup.decode.requests
    assert (prefill.role, prefill.path) == ("prefill", "/v1/chat/completions")
    assert (decode.role, decode.path) == ("decode", "/v1/chat/completions")
    # Fields the proxy does not own pass through both legs untouched.
    for key in ("model", "messages", "temperature", "reasoning_effort", "chat_template_kwargs"):
        assert prefill.body is not None and decode.body is not None
        assert prefill.body[key] == FULL_CHAT[key]
        assert decode.body[key] == FULL_CHAT[key]


def test_prefill_leg_is_lowered_as_the_seed_does() -> None:
    setup = Setup()
    body = {
        "model": "m",
        "prompt": "hello",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "min_tokens": 4,
        "min_completion_tokens": 2,
        "top_p": 0.5,
    }
    setup.post("/v1/completions", body).answer()

    (prefill,) = setup.prefill.requests
    request_id = prefill.request_id
    assert request_id is not None
    assert prefill.body == {
        "model": "m",
        "prompt": "hello",
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "top_p": 0.5,
        "kv_transfer_params": prefill_kv_transfer_params(request_id),
        # (a stream that may move: the prompt's own ids, which a continuation starts from)
        "return_token_ids": True,
    }
    assert prefill.body["kv_transfer_params"]["transfer_id"] == f"xfer-{request_id}"


def test_decode_leg_is_the_client_body_plus_verbatim_params() -> None:
    setup = Setup()
    body = dict(FULL_CHAT, stream=True, stream_options={"include_usage": True}, max_tokens=5)
    setup.post("/v1/chat/completions", body).answer()

    (decode,) = setup.decode.requests
    issued = setup.ledger.redeemed[0]
    # Prefill's params verbatim, plus the prompt's token ids it answered (protocol.md);
    # a stream that may move asks for its tokens' ids (failures.md, "Decode migrations").
    handed = dict(issued, prompt_token_ids=decode.handed_token_ids)
    assert decode.body == dict(body, kv_transfer_params=handed, return_token_ids=True)
    # Nested lists and keys vLLM may add later arrived as issued.
    assert issued["remote_block_ids"] == [[0], [100]]
    assert "x_future_key" in issued
    assert setup.ledger.issued == {}


def test_max_tokens_always_one_on_prefill_even_when_absent() -> None:
    setup = Setup()
    setup.post("/v1/completions", {"model": "m", "prompt": "hi"}).answer()
    prefill_body = setup.prefill.requests[0].body
    assert prefill_body is not None
    assert prefill_body["max_tokens"] == 1
    assert "max_completion_tokens" not in prefill_body
    decode_body = setup.decode.requests[0].body
    assert decode_body is not None
    assert "max_tokens" not in decode_body


def test_query_string_reaches_both_legs() -> None:
    setup = Setup()
    client = setup.post("/v1/completions?debug=1", {"model": "m", "prompt": "hi"})
    assert client.answer().status == 200
    assert setup.prefill.requests[0].path == "/v1/completions"
    assert setup.prefill.requests[0].query == b"debug=1"
    assert setup.decode.requests[0].query == b"debug=1"


# -- streams -------------------------------------------------------------------


def test_stream_relayed_with_decode_status_and_content_type() -> None:
    setup = Setup(tokens=6)
    client = setup.post("/v1/chat/completions", dict(FULL_CHAT, stream=True))

    answer = client.answer()
    assert answer.status == 200
    assert answer.values("content-type") == ["text/event-stream"]
    assert answer.values("content-length") == []
    events = sse_events(client)
    assert events[-1] == "[DONE]"
    words = [e["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert len([w for w in words if w]) == 6


def test_first_chunk_reaches_client_while_decode_holds_the_rest() -> None:
    setup = Setup(tokens=5)
    setup.decode.hold_streams_after(2)
    held = setup.decode.stream_held()
    client = setup.post("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})

    assert held.called
    assert b'"text":"Hello "' in client.answer().body
    # The decode still holds the stream: the proxy passed on what it had.
    assert b"[DONE]" not in client.answer().body
    assert not client.answer().complete

    setup.decode.release()
    setup.proxy.flush()
    assert client.answer().complete
    assert sse_events(client)[-1] == "[DONE]"
    assert len(sse_events(client)) == 6


def test_non_streaming_body_and_length_relayed_exactly() -> None:
    setup = Setup(tokens=4)
    prompt = {"model": "m", "prompt": "one two three four"}
    answer = setup.post("/v1/completions", prompt).answer()
    assert answer.json()["object"] == "text_completion"
    assert answer.json()["choices"][0]["text"] == "Hello from the fake "
    # Decode reports the cached tokens prefill put in kv_transfer_params.
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    lengths = answer.values("content-length")
    if lengths:
        assert lengths == [str(len(answer.body))]


# -- rotation ------------------------------------------------------------------


def test_round_robin_over_each_pool() -> None:
    setup = Setup(prefills=2, decodes=3)
    for _ in range(6):
        setup.post("/v1/completions", {"model": "m", "prompt": "hi"}).answer()
    assert [len(p.requests) for p in setup.prefills] == [3, 3]
    assert [len(d.requests) for d in setup.decodes] == [2, 2, 2]


def test_concurrent_requests_spread_and_all_complete() -> None:
    setup = Setup(prefills=2, decodes=2)
    # Every decode holds its stream: all ten are in flight at once.
    for decode in setup.decodes:
        decode.hold_streams_after(1)
    clients = [setup.post("/v1/chat/completions", dict(FULL_CHAT, stream=True)) for _ in range(10)]
    assert setup.proxy.app.in_flight == 10
    for decode in setup.decodes:
        decode.release()
    setup.proxy.flush()

    assert [c.answer().status for c in clients] == [200] * 10
    assert all(c.answer().complete for c in clients)
    assert [len(p.requests) for p in setup.prefills] == [5, 5]
    assert [len(d.requests) for d in setup.decodes] == [5, 5]
