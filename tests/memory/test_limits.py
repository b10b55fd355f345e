"""Admission limits, in-flight slots given back, overload said once a second, secrets kept."""

from __future__ import annotations

from typing import Any

from twisted.logger import LogLevel, formatEvent

from tests.memory.support import FULL_CHAT, Setup, assert_error

STREAM = dict(FULL_CHAT, stream=True)


def test_a_body_under_the_limit_is_served() -> None:
    setup = Setup(max_body_size=1000)
    client = setup.post("/v1/completions", {"model": "m", "prompt": "x" * 500})
    assert client.answer().status == 200


def test_past_the_in_flight_limit_503_at_once() -> None:
    setup = Setup(max_in_flight=1)
    held = setup.held_stream()

    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert_error(answer, 503, "too_many_requests_in_flight")
    assert answer.values("retry-after") == ["1"]
    assert len(setup.prefill.requests) == 1

    setup.decode.release()
    setup.proxy.flush()
    assert held.answer().complete
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200


#: Each of these once failed after taking an in-flight slot, and never gave it back.
SLOT_LEAKS = [
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": "x"}),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": [1]}),
    ("/v1/completions", b'{"model": "m", "prompt": ["a", "b"], "n": 1e400}'),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "stream_options": "x"}),
    ("/v1/completions", {"model": "m", "prompt": "a\ud800b"}),
    ("/v1/chat/completions", dict(FULL_CHAT, messages=[{"role": "user", "content": "\ud800"}])),
    ("/v1/chat/completions", dict(FULL_CHAT, user="\ud800")),
]


def test_requests_that_fail_after_admission_give_their_slot_back() -> None:
    limit = 3
    setup = Setup(max_in_flight=limit, prefill_policy="cache-aware", decode_policy="session")
    for path, body in SLOT_LEAKS:
        for _ in range(limit + 1):
            assert setup.post(path, body).answer().status in (200, 400), (path, body)
    assert setup.proxy.app.in_flight == 0
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert answer.status == 200, answer.body


def test_a_batch_field_the_proxy_merges_by_is_a_400_not_a_500() -> None:
    setup = Setup()
    body = {"model": "m", "prompt": ["a", "b"], "stream": "false"}
    answer = setup.post("/v1/completions", body).answer()
    assert_error(answer, 400, "invalid_batch_field")
    assert "'stream' must be true or false" in answer.json()["error"]["message"]
    assert setup.prefill.requests == []


def test_overload_refusals_are_counted_each_and_logged_once_a_second(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup(max_in_flight=1)
    held = setup.held_stream()
    for _ in range(30):
        answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
        assert_error(answer, 503, "too_many_requests_in_flight")
    setup.proxy.advance(1)
    setup.decode.release()
    setup.proxy.flush()
    assert held.answer().complete

    said = [formatEvent(e) for e in logged if e.get("log_level") >= LogLevel.warn]
    assert len(said) == 2, said  # the first, then "29 more like it"
    assert "29 more like it" in said[1]
    access = [e for e in logged if e.get("log_namespace") == "nixlproxy.access"]
    assert len(access) == 31  # the access event of each stays
    assert 'nixlproxy_refused_total{reason="too_many_requests_in_flight"} 30.0' in setup.metrics()


def test_authorization_never_reaches_a_log_line_or_an_error_body(
    logged: list[dict[str, Any]],
) -> None:
    secret = "sk-very-secret-value"
    setup = Setup(backend_api_key="sk-operator-secret")
    auth = {"Authorization": f"Bearer {secret}"}
    setup.prefill.crash_next(500)
    setup.decode.break_next()
    bodies = [
        setup.post("/v1/chat/completions", body, auth).answer().body  # the cut-off one too
        for body in (FULL_CHAT, b"{nope", STREAM, FULL_CHAT)
    ]
    lines = [formatEvent(e) + repr(e.get("log_failure", "")) for e in logged]
    assert lines
    for text in [*lines, *(b.decode("utf-8", "replace") for b in bodies)]:
        assert secret not in text
        assert "sk-operator-secret" not in text


# -- a tenant's tokens per minute ------------------------------------------------------

TEAM = {"x-team": "team-a"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 64}}


def test_a_request_without_max_tokens_is_charged_its_models_context_until_vllm_says() -> None:
    setup = Setup(tenant_header="x-team", tenant_tokens_per_minute=40)
    assert setup.decode.max_model_len == 1024  # (its card says so; the health checks read it)
    setup.decode.hold_answers()
    first = setup.post("/v1/chat/completions", FULL_CHAT, TEAM)  # (nothing in its window)
    # While it runs it may generate up to its model's context: nothing else fits.
    small = dict(FULL_CHAT, max_tokens=1)
    answer = setup.post("/v1/chat/completions", small, TEAM).answer()
    assert_error(answer, 429, "rate_limit_exceeded")
    assert "40 tokens per minute" in answer.json()["error"]["message"]
    setup.decode.release()
    setup.proxy.flush()
    used = first.answer().json()["usage"]["total_tokens"]
    assert used <= 20  # (the fake's 8 tokens and its prompt)
    # Then it is charged what vLLM said it used: a small request fits again.
    assert setup.post("/v1/chat/completions", small, TEAM).answer().status == 200


def test_an_image_part_is_charged_its_estimate_while_it_runs() -> None:
    setup = Setup(tenant_header="x-team", tenant_tokens_per_minute=40)
    setup.decode.hold_answers()
    first = setup.post("/v1/chat/completions", dict(FULL_CHAT, max_tokens=2), TEAM)
    pictured = dict(
        FULL_CHAT,
        max_tokens=2,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, IMAGE]}],
    )
    answer = setup.post("/v1/chat/completions", pictured, TEAM).answer()
    assert_error(answer, 429, "rate_limit_exceeded")  # (was: charged its 2 tokens alone)
    setup.decode.release()
    setup.proxy.flush()
    assert first.answer().status == 200
