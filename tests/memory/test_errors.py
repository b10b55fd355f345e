"""Every error a client can get, and that no backend is called when none should be."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.logger import LogLevel, formatEvent

from nixl_twisted import __version__
from nixl_twisted.protocol.lowering import prompt_count
from nixl_twisted.testing import TransferLedger
from tests.memory.support import FULL_CHAT, Setup, assert_error, sse_events

# -- the client's mistakes -------------------------------------------------------


def test_invalid_json_is_400_and_no_backend_called() -> None:
    setup = Setup()
    for raw in (b"{not json", b"", b'{"prompt": NaN}', b"\xff\xfe"):
        assert_error(setup.post("/v1/completions", raw).answer(), 400, "invalid_json")
    assert setup.prefill.requests + setup.decode.requests == []


#: A body of each route that parses one, with a number no double holds in a field.
_OVERFLOWING = {
    "/v1/completions": b'{"model": "m", "prompt": "hi", "temperature": 1e400}',
    "/v1/chat/completions": b'{"model": "m", "messages": [], "logit_bias": {"1": -1e400}}',
    "/v1/responses": b'{"model": "m", "input": "hi", "top_p": 1E+999}',
    "/v1/messages": b'{"model": "m", "max_tokens": 5, "messages": [], "temperature": 1e400}',
    "/v1/messages/count_tokens": b'{"model": "m", "messages": [], "x": 1e400}',
    "/tokenize": b'{"model": "m", "prompt": "hi", "x": [1e400]}',
    "/detokenize": b'{"model": "m", "tokens": [1], "x": 1e400}',
    "/v1/responses/resp_1/cancel": b'{"x": 1e400}',
}


def test_a_number_too_large_for_a_double_is_400_on_every_route(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup()
    for path, raw in _OVERFLOWING.items():
        answer = setup.post(path, raw).answer()
        assert answer.status == 400, (path, answer.body)
        said = answer.json()["error"]
        assert "1e400" in said["message"].lower() or "1e+999" in said["message"].lower()
        if "messages" not in path:  # (Anthropic's error shape has no code)
            assert said["code"] == "invalid_json"
    assert setup.prefill.requests + setup.decode.requests == []
    assert not [e for e in logged if e.get("log_level") in (LogLevel.critical, LogLevel.error)]


def test_body_that_is_not_an_object_is_400() -> None:
    setup = Setup()
    for body in ([FULL_CHAT], "text", 3, None):
        answer = setup.post("/v1/chat/completions", body).answer()
        assert_error(answer, 400, "invalid_body")
        assert "JSON object" in answer.json()["error"]["message"]
    assert setup.prefill.requests == []


def test_a_batch_never_reaches_a_backend_as_one_request() -> None:
    setup = Setup()
    for prompt in (["a", "b"], [[1, 2], [3, 4]]):
        answer = setup.post("/v1/completions", {"model": "m", "prompt": prompt}).answer()
        assert answer.status == 200
    # Each backend request carries one prompt: four parts, never a list of two.
    for fake in (setup.prefill, setup.decode):
        assert len(fake.requests) == 4
        for received in fake.requests:
            assert received.body is not None
            assert prompt_count(received.body["prompt"]) == 1


def test_single_prompt_lists_are_served() -> None:
    setup = Setup()
    for prompt in (["just one"], [1, 2, 3], [[1, 2, 3]]):
        answer = setup.post("/v1/completions", {"model": "m", "prompt": prompt}).answer()
        assert answer.status == 200
    assert len(setup.decode.requests) == 3


def test_unknown_path_and_wrong_method_are_json_4xx() -> None:
    setup = Setup()
    assert_error(setup.get("/v1/embeddings").answer(), 404, "not_found")
    answer = setup.get("/v1/completions").answer()
    assert_error(answer, 405, "method_not_allowed")
    assert answer.values("allow") == ["POST"]


# -- prefill fails ---------------------------------------------------------------


def test_prefill_4xx_is_relayed_with_its_status_and_body() -> None:
    setup = Setup()
    setup.prefill.refuse_next(400, "This model's maximum context length is 8 tokens")
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert answer.status == 400
    error = answer.json()["error"]
    assert error["message"] == "This model's maximum context length is 8 tokens"
    assert error["type"] == "BadRequestError"
    assert setup.decode.requests == []


def test_prefill_5xx_is_502_naming_leg_and_instance() -> None:
    setup = Setup()
    setup.prefill.crash_next(500)
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert_error(answer, 502, "prefill_failed")
    assert answer.json()["error"]["message"] == "the prefill instance answered HTTP 500"
    assert setup.prefill.url not in answer.body.decode()  # (the log and access event say it)
    assert setup.decode.requests == []


def test_unreachable_prefill_is_502() -> None:
    setup = Setup()
    setup.proxy.stop_serving(setup.prefill)
    dead = setup.prefill.url
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert_error(answer, 502, "prefill_unreachable")
    assert answer.json()["error"]["message"] == "a prefill instance could not be reached"
    assert dead not in answer.body.decode()
    assert setup.decode.requests == []


def test_missing_kv_transfer_params_is_502_as_the_seed_says() -> None:
    setup = Setup()
    setup.prefill.omit_kv_transfer_params_next()
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert_error(answer, 502, "missing_kv_transfer_params")
    message = answer.json()["error"]["message"]
    assert "prefill response did not include kv_transfer_params" in message
    assert setup.prefill.url in message
    assert setup.decode.requests == []


# -- decode fails ----------------------------------------------------------------


def test_unreachable_decode_is_502() -> None:
    setup = Setup()
    setup.proxy.stop_serving(setup.decode)
    dead = setup.decode.url
    answer = setup.post("/v1/chat/completions", dict(FULL_CHAT, stream=True)).answer()
    assert_error(answer, 502, "decode_unreachable")
    assert dead not in answer.body.decode()
    assert answer.json()["error"]["message"] == "a decode instance could not be reached"
    assert len(setup.prefill.requests) == 1


def test_decode_error_answers_are_relayed_as_they_are() -> None:
    setup = Setup()
    for status in (400, 500):
        setup.decode.crash_next(status, f"decode says {status}")
        answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
        assert answer.status == status
        assert answer.json()["error"]["message"] == f"decode says {status}"
        assert answer.json()["error"]["code"] == status


def test_kv_load_failure_on_decode_reaches_client() -> None:
    # A decode that cannot load the KV blocks (here: it never heard of
    # them) answers 500, and the client gets that answer.
    setup = Setup()
    setup.decode.ledger = TransferLedger()
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert answer.status == 500
    assert "KV load failed" in answer.json()["error"]["message"]


# -- bodies cut off --------------------------------------------------------------


def test_a_stream_cut_off_ends_with_an_error_event_not_a_clean_end() -> None:
    setup = Setup(tokens=5, decode_migrations=0)
    setup.decode.break_next(after_events=2)
    client = setup.post("/v1/chat/completions", dict(FULL_CHAT, stream=True))
    assert client.answer().status == 200
    # Closed short: never passed off as complete.
    assert not client.answer().complete and client.lost
    events = sse_events(client)
    assert len(events) == 3
    assert events[-1]["error"]["code"] == "decode_stream_broken"
    # Said for people, no Python reprs (the detail is in the proxy's log).
    assert events[-1]["error"]["message"] == "decode closed the stream early"
    assert "[DONE]" not in events


def test_every_answer_says_server_nixl_twisted() -> None:
    setup = Setup()
    relayed = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    own = setup.get("/healthcheck").answer()
    for answer in (relayed, own):
        assert answer.values("server") == [f"nixl-twisted/{__version__}"]


def test_a_json_body_cut_off_is_never_finished_as_complete() -> None:
    # A whole answer is held until it is complete (decode's handle may be at its end): cut
    # off, none of it reached the client, and a status says what happened.
    setup = Setup(decode_migrations=0)
    setup.decode.break_next()
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert_error(answer, 502, "decode_stream_broken")


def test_a_prefill_answer_cut_off_is_502() -> None:
    setup = Setup()
    setup.prefill.break_next()
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert_error(answer, 502, "prefill_invalid_response")
    assert setup.decode.requests == []


def test_the_proxy_serves_on_after_a_broken_backend() -> None:
    setup = Setup(decode_migrations=0)
    setup.decode.break_next()
    broken = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert_error(broken, 502, "decode_stream_broken")
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert answer.status == 200
    assert answer.json()["object"] == "text_completion"


def test_garbage_from_prefill_is_502_with_an_error_line_naming_the_request(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup()
    setup.prefill.answer_next_with(200, b"<html>oops</html>", b"text/html")
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert_error(answer, 502, "prefill_invalid_response")
    (request_id,) = answer.values("x-request-id")
    errors = [formatEvent(e) for e in logged if e.get("log_level") == LogLevel.error]
    assert any(request_id in line for line in errors), errors
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200  # it serves on


def test_a_bad_handoff_is_retried_on_another_prefill_and_never_reaches_decode() -> None:
    setup = Setup(prefills=2)
    first, second = setup.prefills
    first.spoil_kv_transfer_params_next(remote_block_ids=[])
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert answer.status == 200
    assert [len(p.requests_for("prefill")) for p in setup.prefills] == [1, 1]
    (decoded,) = setup.decode.requests_for("decode")
    assert decoded.body is not None
    assert decoded.body["kv_transfer_params"]["remote_engine_id"] == second.name
    m = setup.scrape()
    problem = (("instance", first.url), ("problem", "no_blocks"))
    assert m[("nixlproxy_prefill_bad_handoffs_total", problem)] == 1
    outcome = (("instance", first.url), ("outcome", "bad_handoff"), ("pool", "prefill"))
    assert m[("nixlproxy_backend_requests_total", outcome)] == 1


def test_a_bad_handoff_from_every_prefill_is_502_bad_kv_transfer_params() -> None:
    setup = Setup()
    setup.prefill.spoil_kv_transfer_params_next(remote_port=None)
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert_error(answer, 502, "bad_kv_transfer_params")
    assert setup.decode.requests == []


def test_a_bad_handoff_falls_back_to_decode_alone_when_told() -> None:
    setup = Setup(prefill_fallback="decode")
    setup.prefill.spoil_kv_transfer_params_next(do_remote_prefill=False)
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert answer.status == 200
    (alone,) = setup.decode.requests
    assert alone.role == "plain" and not alone.carried_kv_transfer_params


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("169.254.169.254", ()),
        ("fd00:ec2::254", ()),
        ("[fd00:ec2::254]", ()),
        ("metadata.google.internal", ()),
        ("10.9.9.9", ("10.0.0.0/16",)),
        ("169.254.169.254", ("169.254.0.0/16",)),  # (metadata: only listed alone)
    ],
)
def test_a_handoff_pointing_decode_at_a_host_not_allowed_is_a_failed_prefill(
    host: str, allowed: tuple[str, ...], logged: list[dict[str, Any]]
) -> None:
    setup = Setup(allowed_backends=list(allowed))
    setup.prefill.spoil_kv_transfer_params_next(remote_host=host)
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert_error(answer, 502, "bad_kv_transfer_params")
    assert "remote_host" in answer.json()["error"]["message"]
    assert setup.decode.requests == []  # (decode's NIXL handshake never pointed there)
    problem = (("instance", setup.prefill.url), ("problem", "disallowed_host"))
    assert setup.scrape()[("nixlproxy_prefill_bad_handoffs_total", problem)] == 1
    warned = [formatEvent(e) for e in logged if e.get("log_level") == LogLevel.warn]
    assert any("remote_host" in line for line in warned), warned


def test_a_handoff_host_allowed_reaches_decode() -> None:
    setup = Setup(allowed_backends=["10.0.0.0/16", "127.0.0.0/8"])
    answer = setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    assert answer.status == 200
    (decoded,) = setup.decode.requests_for("decode")
    assert decoded.body is not None
    assert decoded.body["kv_transfer_params"]["remote_host"] == "127.0.0.1"
