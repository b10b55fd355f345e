"""Never hang, never leak: a client leaving after prefill answered, timeouts, long streams."""

from __future__ import annotations

from tests.memory.support import FULL_CHAT, TIMEOUTS, Setup, assert_error, sse_events

STREAM = dict(FULL_CHAT, stream=True)


def test_a_client_leaving_after_prefill_answered_still_sends_decode_to_free_blocks() -> None:
    setup = Setup()
    setup.prefill.hold_answers_midway()  # prefill has answered, its body not all here
    client = setup.post("/v1/chat/completions", STREAM)
    assert setup.phase() == "handoff"  # the proxy has prefill's headers
    client.disconnect()

    setup.decode.hold_streams_after(1)
    decode_held = setup.decode.stream_held()
    setup.prefill.release()
    setup.proxy.flush()
    assert decode_held.called
    # Decode got the leg with prefill's params: it will free prefill's blocks ...
    (decode_request,) = setup.decode.requests
    assert decode_request.body is not None
    assert setup.ledger.redeemed == [decode_request.connector_params]
    # ... and once it answers, the proxy drops it: nobody is left to read it.
    assert setup.decode.disconnects == 1
    setup.decode.release()
    setup.proxy.flush()
    assert setup.decode.disconnects == 1
    assert setup.proxy.app.in_flight == 0


def test_prefill_that_does_not_answer_is_504_and_its_connection_closed() -> None:
    setup = Setup()
    setup.prefill.hold_answers()
    held = setup.prefill.stream_held()
    client = setup.post("/v1/chat/completions", FULL_CHAT)
    assert held.called
    setup.proxy.advance(TIMEOUTS.prefill)
    answer = client.answer()
    assert_error(answer, 504, "prefill_timeout")
    assert answer.json()["error"]["message"] == "a prefill instance did not answer within 300 s"
    assert setup.prefill.disconnects == 1
    assert setup.decode.requests == []


def test_decode_that_does_not_answer_is_504() -> None:
    setup = Setup()
    setup.decode.hold_answers()
    held = setup.decode.stream_held()
    client = setup.post("/v1/chat/completions", FULL_CHAT)
    assert held.called
    setup.proxy.advance(TIMEOUTS.decode)
    assert_error(client.answer(), 504, "decode_timeout")
    assert setup.decode.disconnects == 1  # vLLM aborts the request and frees its blocks


def test_a_long_generation_that_keeps_producing_is_never_cut() -> None:
    setup = Setup(tokens=6)  # the fake's tokens come on the proxy's clock
    setup.decode.token_interval = TIMEOUTS.stream_idle * 0.9
    client = setup.post("/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    words = ["Hello ", "from ", "the ", "fake ", "decode ", "instance: "]
    for word in words:
        assert word.encode() in client.received()  # the proxy has relayed it
        setup.proxy.advance(setup.decode.token_interval)
    assert client.answer().complete
    events = sse_events(client)
    assert [e["choices"][0]["text"] for e in events[:-1]] == words
    assert events[-1] == "[DONE]"


def test_a_stream_that_stalls_after_some_tokens_ends_one_idle_timeout_after_its_last() -> None:
    setup = Setup(tokens=6, decode_migrations=0)  # the fake's tokens come on the proxy's clock
    setup.decode.token_interval = TIMEOUTS.stream_idle * 0.4
    setup.decode.hold_streams_after(3)
    client = setup.post("/v1/chat/completions", STREAM)
    for _ in range(2):  # the second token, then the third and last
        setup.proxy.advance(setup.decode.token_interval)
    relayed = client.received()
    setup.proxy.advance(TIMEOUTS.stream_idle - 0.001)
    assert client.received() == relayed and not client.lost  # silent, but not for long enough
    setup.proxy.advance(0.001)
    assert sse_events(client)[-1]["error"]["code"] == "decode_timeout"
    assert client.lost
    assert setup.decode.disconnects == 1
