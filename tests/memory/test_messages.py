"""Anthropic's Messages API: the proxy's own errors and a broken stream in Anthropic's shapes."""

from __future__ import annotations

import json
from typing import Any

from tests.memory.support import Setup

ASK: dict[str, Any] = {
    "model": "m",
    "max_tokens": 6,
    "messages": [{"role": "user", "content": "What does decode pull over NIXL?"}],
}


def test_the_proxys_own_errors_have_anthropics_shape() -> None:
    setup = Setup()
    answer = setup.post("/v1/messages", b"{nope").answer()
    assert answer.status == 400
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in answer.json()["error"]["message"]
    setup.proxy.stop_serving(setup.decode)
    answer = setup.post("/v1/messages", ASK).answer()
    assert (answer.status, answer.json()["error"]["type"]) == (502, "api_error")


def test_a_broken_stream_ends_with_anthropics_error_event() -> None:
    setup = Setup(tokens=5, decode_migrations=0)
    setup.decode.break_next(after_events=2)
    client = setup.post("/v1/messages", dict(ASK, stream=True))
    answer = client.answer()
    assert answer.status == 200
    assert not answer.complete and client.lost  # closed short: never passed off as complete
    last = answer.body.strip().split(b"\n\n")[-1]
    event, data = last.split(b"\n", 1)
    assert event == b"event: error"
    error = json.loads(data.removeprefix(b"data: "))
    assert error["type"] == "error"
    assert error["error"]["message"] == "decode closed the stream early"
