"""Property-based: whatever clients send and backends answer, the proxy answers
with a status and an OpenAI error body, never a traceback, and serves on."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nixl_twisted.backends.capacity import COOL
from tests.memory.support import FULL_CHAT, Setup

EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None
)

json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=20)
not_objects = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3), max_leaves=6).map(
    lambda v: json.dumps(v).encode()
)
garbage = st.binary(max_size=200).filter(lambda b: not _is_object(b))
header_names = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters=":"),
    min_size=1,
    max_size=20,
)
header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60
).map(str.strip)


#: Any JSON value, lone surrogates, huge and tiny numbers and nesting included.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["\ud800", "a\udfffb", "", "user", "false", "1"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
#: A valid body per two-leg route: each example changes one field of it.
TWO_LEG_BODIES = {
    "/v1/completions": {"model": "m", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": FULL_CHAT,
    "/v1/responses": {"model": "m", "input": "hello", "max_output_tokens": 4},
    "/v1/messages": {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}],
    },
}
#: The fields the proxy or vLLM reads on those routes, and any other name.
FIELDS = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "input",
        "n",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "min_tokens",
        "user",
        "store",
        "background",
        "previous_response_id",
        "kv_transfer_params",
        "system",
        "temperature",
    ]
) | st.text(max_size=10)


def _is_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def post(setup: Setup, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    """One request on its own connection, closed after the answer (as ``http.client`` does)."""
    client = setup.proxy.request("POST", path, body, headers)
    answer = client.answer()
    client.disconnect()
    return answer.status, (answer.headers.get("content-type"), answer.body)


def assert_openai_error(status: int, answer: tuple[str | None, bytes]) -> None:
    content_type, data = answer
    assert 400 <= status < 600, status
    assert content_type == "application/json", (status, content_type, data)
    error = json.loads(data)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]


def serves_on(setup: Setup) -> None:
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert answer.status == 200
    assert answer.json()["object"] == "chat.completion"


def reset_health(setup: Setup) -> None:
    for pool in setup.proxy.service.backends.pools():
        for instance in pool.instances:
            while not instance.healthy or instance.failures:
                pool.record_success(instance)


def test_malformed_client_bodies() -> None:
    setup = Setup()

    @EXAMPLES
    @given(
        path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        body=not_objects | garbage,
    )
    def check(path: str, body: bytes) -> None:
        status, answer = post(setup, path, body, {"Content-Type": "application/json"})
        assert status == 400, status
        assert_openai_error(status, answer)

    check()
    assert setup.prefill.requests == []
    serves_on(setup)


def test_any_json_value_in_any_field_of_a_two_leg_route_is_never_a_5xx() -> None:
    # Routing keys are worked out (cache-aware, session) and the slots are
    # few: a request that failed after admission without giving its slot
    # back would turn the next ones into 503s.
    setup = Setup(max_in_flight=2, prefill_policy="cache-aware", decode_policy="session")

    @settings(EXAMPLES, max_examples=150, derandomize=True)
    @given(
        path=st.sampled_from(sorted(TWO_LEG_BODIES)),
        changes=st.dictionaries(FIELDS, json_values, min_size=1, max_size=3),
        batched=st.booleans(),
    )
    def check(path: str, changes: dict[str, Any], batched: bool) -> None:
        body = dict(TWO_LEG_BODIES[path])
        if batched and path == "/v1/completions":
            body["prompt"] = ["hello", "there"]
        body.update(changes)
        status, answer = post(setup, path, json.dumps(body).encode(), {})
        assert status < 500, (status, body, answer)
        if status >= 400 and answer[0] == "application/json":
            assert "error" in json.loads(answer[1]), answer

    check()
    assert setup.proxy.app.in_flight == 0
    serves_on(setup)


def test_odd_headers_never_break_a_request() -> None:
    setup = Setup()
    body = json.dumps(FULL_CHAT).encode()

    @EXAMPLES
    @given(headers=st.dictionaries(header_names, header_values, max_size=6))
    def check(headers: dict[str, str]) -> None:
        status, answer = post(setup, "/v1/chat/completions", body, headers)
        if status != 200:
            assert 400 <= status < 500, (status, headers)
            assert_openai_error(status, answer)

    check()
    serves_on(setup)


def test_whatever_prefill_answers() -> None:
    setup = Setup()
    body = json.dumps(FULL_CHAT).encode()

    @EXAMPLES
    @given(
        status=st.sampled_from([200, 201, 204, 301, 400, 404, 422, 500, 502, 503]),
        answer=garbage | not_objects | st.just(b'{"kv_transfer_params": 7}'),
    )
    def check(status: int, answer: bytes) -> None:
        setup.prefill.answer_next_with(status, answer)
        got, answered = post(setup, "/v1/chat/completions", body, {})
        if 400 <= status < 500:
            assert got == status and answered[1] == answer  # relayed
        else:
            assert got in (502, 503), (status, answer, got)
            assert_openai_error(got, answered)
        # A failed prefill may take it out of rotation: put it back.
        reset_health(setup)

    check()
    assert setup.decode.requests == []
    serves_on(setup)


def test_whatever_decode_answers_is_relayed_as_it_is() -> None:
    """But a 503, vLLM's engine queue full: another instance is asked (none here: 503)."""
    setup = Setup()
    body = json.dumps(FULL_CHAT).encode()

    @EXAMPLES
    @given(status=st.sampled_from([200, 400, 404, 500, 503]), answer=st.binary(max_size=200))
    def check(status: int, answer: bytes) -> None:
        setup.decode.answer_next_with(status, answer, b"text/plain")
        got, answered = post(setup, "/v1/chat/completions", body, {})
        if status == 503:
            assert got == 503 and b'"engine_full"' in answered[1], answered
            setup.proxy.advance(COOL)  # (it counted as full a moment)
        else:
            assert (got, answered) == (status, ("text/plain", answer))
        reset_health(setup)

    check()
    serves_on(setup)
