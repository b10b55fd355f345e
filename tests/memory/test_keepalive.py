"""``--sse-keepalive``: comment frames while a stream waits for its first token, on the Clock."""

from __future__ import annotations

from typing import Any

from tests.memory.support import FULL_CHAT, TIMEOUTS, Setup, sse_payloads

STREAM = dict(FULL_CHAT, stream=True)
FRAME = b": keep-alive\n\n"
EVERY = 15.0


def _body(setup: Setup, raw: bytes) -> bytes:
    """What the client got after the headers, chunked transfer coding taken off."""
    _, _, chunked = raw.partition(b"\r\n\r\n")
    body = b""
    while chunked:
        size, _, rest = chunked.partition(b"\r\n")
        length = int(size, 16)
        body += rest[:length]
        chunked = rest[length + 2 :]
        if length == 0:
            break
    return body


def _held_by(leg: str) -> tuple[Setup, Any]:
    """A kept-alive stream whose ``leg`` ("prefill" or "decode") holds its answer."""
    setup = Setup(sse_keepalive=EVERY)
    fake = setup.prefill if leg == "prefill" else setup.decode
    fake.hold_answers()
    held = fake.stream_held()
    client = setup.post("/v1/chat/completions", STREAM)
    assert held.called
    return setup, client


def test_frames_every_interval_while_prefill_runs_and_none_after_the_first_token() -> None:
    setup, client = _held_by("prefill")
    setup.proxy.advance(EVERY - 0.1)
    assert client.received() == b""  # not before the interval
    setup.proxy.advance(0.1)
    answer = client.answer()
    assert answer.status == 200
    assert answer.values("content-type") == ["text/event-stream"]
    assert answer.values("cache-control") == ["no-cache"]
    assert answer.values("x-request-id")  # (set at the door: every answer has one)
    assert _body(setup, client.received()) == FRAME
    setup.proxy.advance(EVERY)
    assert _body(setup, client.received()) == FRAME * 2

    # Decode's first token stops them: none while the rest of the stream is held.
    setup.decode.hold_streams_after(1)
    decode_held = setup.decode.stream_held()
    setup.prefill.release()
    setup.proxy.flush()
    assert decode_held.called
    first = _body(setup, client.received())
    assert first.startswith(FRAME * 2 + b"data: ")
    for _ in range(3):  # (below --stream-idle-timeout)
        setup.proxy.advance(EVERY)
    assert _body(setup, client.received()) == first
    setup.decode.release()
    setup.proxy.flush()
    answer = client.answer()
    assert answer.complete
    assert answer.body.count(FRAME) == 2
    events = sse_payloads(answer.body)
    assert events[-1] == "[DONE]"
    assert all("error" not in event for event in events[:-1])


def test_frames_while_decode_has_not_answered() -> None:
    setup, client = _held_by("decode")
    assert setup.phase() == "handoff"
    for _ in range(3):
        setup.proxy.advance(EVERY)  # (Clock.advance runs no call set during it)
    assert _body(setup, client.received()) == FRAME * 3
    setup.decode.release()
    setup.proxy.flush()
    answer = client.answer()
    assert answer.complete and answer.status == 200
    assert sse_payloads(answer.body)[-1] == "[DONE]"


def test_off_by_default_and_for_a_request_not_streamed() -> None:
    for setup, body in ((Setup(), STREAM), (Setup(sse_keepalive=EVERY), FULL_CHAT)):
        setup.prefill.hold_answers()
        client = setup.post("/v1/chat/completions", body)
        for _ in range(4):
            setup.proxy.advance(EVERY)
        assert client.received() == b""
        setup.prefill.release()
        setup.proxy.flush()
        assert FRAME not in client.answer().body


def _late(setup: Setup, client: Any) -> dict[str, Any]:
    answer = client.answer()
    assert answer.status == 200  # (the headers went out with the first frame)
    assert answer.complete  # an answer that is the error, not one cut short
    assert answer.body.startswith(FRAME)
    (event,) = sse_payloads(answer.body)
    assert isinstance(event, dict)
    return event


def test_a_failure_after_the_first_frame_is_an_error_event_in_the_routes_shape() -> None:
    setup = Setup(sse_keepalive=EVERY)
    setup.prefill.hold_answers()
    client = setup.post("/v1/chat/completions", STREAM)
    setup.proxy.advance(EVERY)
    setup.proxy.advance(TIMEOUTS.prefill)
    event = _late(setup, client)
    assert event["error"]["code"] == "prefill_timeout"
    assert event["error"]["type"] == "upstream_error"
    assert event["error"]["message"] == "a prefill instance did not answer within 300 s"
    assert setup.decode.requests == []
    # The access event and the metrics say the status it would have had.
    counted = {
        dict(labels)["status"]: value
        for (name, labels), value in setup.scrape().items()
        if name == "nixlproxy_requests_total"
    }
    assert counted == {"504": 1.0}


def test_a_messages_stream_failing_late_ends_with_anthropics_error_event() -> None:
    setup = Setup(sse_keepalive=EVERY)
    setup.decode.hold_answers()  # (the fake holds no Messages answer of prefill's)
    body = {
        "model": "fake-model",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    client = setup.post("/v1/messages", body)
    setup.proxy.advance(EVERY)
    setup.proxy.advance(TIMEOUTS.decode)
    raw = client.answer().body
    assert raw.startswith(FRAME)
    assert raw.replace(FRAME, b"").startswith(b"event: error\ndata: ")
    (event,) = sse_payloads(raw)
    assert event["type"] == "error"
    assert event["error"]["type"] == "api_error"


def test_a_refusal_after_the_first_frame_is_the_backends_error_as_an_event() -> None:
    setup = Setup(sse_keepalive=EVERY)
    setup.prefill.hold_answers()
    client = setup.post("/v1/chat/completions", STREAM)
    setup.proxy.advance(EVERY)
    setup.decode.refuse_next(400, "this decode says no")
    setup.prefill.release()
    setup.proxy.flush()
    event = _late(setup, client)
    assert event["error"]["message"] == "this decode says no"

    # Queued behind a stream that holds decode's only slot (and one prefilled ahead for
    # it), then refused by prefill.
    setup = Setup(sse_keepalive=EVERY, decode_max_in_flight=1)
    first = setup.held_stream()
    setup.post("/v1/chat/completions", STREAM)
    client = setup.post("/v1/chat/completions", STREAM)
    assert {e.phase.value for e in setup.proxy.app.serving.exchanges} == {"relay", "queued"}
    setup.proxy.advance(EVERY)
    setup.prefill.refuse_next(400, "this prefill says no")
    setup.decode.release()
    setup.proxy.flush()
    assert first.answer().complete
    event = _late(setup, client)
    assert event["error"]["message"] == "this prefill says no"
    assert len(setup.decode.requests) == 2
