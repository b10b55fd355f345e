"""Request ids, headers, authorization, and the routes besides the two-leg ones."""

from __future__ import annotations

from typing import Any

from tests.memory.support import FULL_CHAT, Setup, assert_error

# -- request ids -----------------------------------------------------------------


def test_one_fresh_id_on_both_legs_in_transfer_id_and_to_the_client() -> None:
    setup = Setup()
    # vLLM can echo an id of its own; the client still gets the proxy's.
    setup.decode.extra_headers["X-Request-Id"] = "decode-echo"
    seen = set()
    for sent in ("", "two words", "x" * 129):  # (none that is a sane token)
        answer = setup.post("/v1/chat/completions", FULL_CHAT, headers={"X-Request-Id": sent})
        (echoed,) = answer.answer().values("x-request-id")
        seen.add(echoed)
    assert len(seen) == 3
    assert all(len(one) == 32 for one in seen)
    for prefill, decode in zip(setup.prefill.requests, setup.decode.requests, strict=True):
        assert prefill.request_id in seen
        assert prefill.request_id == decode.request_id
        assert prefill.body is not None
        assert prefill.body["kv_transfer_params"]["transfer_id"] == f"xfer-{prefill.request_id}"


def test_a_clients_sane_request_id_is_kept_on_both_legs_and_in_its_record(
    access_events: list[dict[str, Any]],
) -> None:
    setup = Setup()
    setup.decode.extra_headers["X-Request-Id"] = "decode-echo"
    for _ in range(2):  # (reused: vLLM adds its own suffix, and prefill's params say which)
        answer = setup.post(
            "/v1/chat/completions", FULL_CHAT, headers={"X-Request-Id": "gw-7f3a:01"}
        ).answer()
        assert answer.status == 200
        assert answer.values("x-request-id") == ["gw-7f3a:01"]
    models = setup.get("/v1/models", headers={"X-Request-Id": "gw-7f3a:02"}).answer()
    assert models.values("x-request-id") == ["gw-7f3a:02"]
    prefill, decode = setup.prefill.requests, setup.decode.requests_for("decode")
    assert [r.request_id for r in prefill + decode] == ["gw-7f3a:01"] * 4
    assert all(
        r.body and r.body["kv_transfer_params"]["transfer_id"] == "xfer-gw-7f3a:01" for r in prefill
    )
    assert [e["request_id"] for e in access_events] == ["gw-7f3a:01", "gw-7f3a:01", "gw-7f3a:02"]


def test_refusals_carry_a_request_id_too() -> None:
    setup = Setup()
    setup.prefill.extra_headers["X-Request-Id"] = "prefill-echo"
    setup.prefill.refuse_next(400)
    refused = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    invalid = setup.post("/v1/chat/completions", b"[]").answer()
    (refused_id,) = refused.values("x-request-id")
    assert refused_id == setup.prefill.requests[0].request_id
    assert len(invalid.values("x-request-id")) == 1


# -- authorization ---------------------------------------------------------------


def test_client_authorization_reaches_both_legs() -> None:
    setup = Setup(backend_api_key="operator-key")
    setup.post(
        "/v1/chat/completions", FULL_CHAT, headers={"Authorization": "Bearer client-key"}
    ).answer()
    assert setup.prefill.requests[0].authorization == "Bearer client-key"
    assert setup.decode.requests[0].authorization == "Bearer client-key"


def test_operator_key_used_when_client_sends_none() -> None:
    setup = Setup(backend_api_key="operator-key")
    setup.post("/v1/chat/completions", FULL_CHAT).answer()
    setup.get("/v1/models").answer()
    for request in setup.prefill.requests + setup.decode.requests:
        assert request.authorization == "Bearer operator-key"


def test_no_authorization_without_client_or_operator_key() -> None:
    setup = Setup()
    setup.post("/v1/chat/completions", FULL_CHAT).answer()
    assert setup.prefill.requests[0].authorization is None
    assert setup.decode.requests[0].authorization is None


# -- headers ---------------------------------------------------------------------


def test_trace_context_forwarded_hop_by_hop_not() -> None:
    setup = Setup()
    setup.post(
        "/v1/chat/completions",
        FULL_CHAT,
        headers={
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "only for this connection",
            "Keep-Alive": "timeout=5",
        },
    ).answer()
    for request in (setup.prefill.requests[0], setup.decode.requests[0]):
        headers = request.headers
        assert headers.getRawHeaders(b"traceparent") == [
            b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ]
        assert headers.getRawHeaders(b"x-hop") is None
        assert headers.getRawHeaders(b"keep-alive") is None
        assert headers.getRawHeaders(b"content-type") == [b"application/json"]


def test_only_the_key_trace_context_and_named_headers_reach_the_legs() -> None:
    # Forwarded, X-Forwarded-For, Cookie and Range reached both legs.
    setup = Setup(forward_header=["X-Team"])
    sent = {
        "Authorization": "Bearer client",
        "Forwarded": "for=203.0.113.9",
        "X-Forwarded-For": "203.0.113.9",
        "Cookie": "session=1",
        "Range": "bytes=0-1",
        "X-Team": "blue",
    }
    assert setup.post("/v1/chat/completions", FULL_CHAT, headers=sent).answer().status == 200
    for request in (setup.prefill.requests[0], setup.decode.requests[0]):
        names = {name.lower() for name, _ in request.headers.getAllRawHeaders()}
        assert names & {b"forwarded", b"x-forwarded-for", b"cookie", b"range"} == set()
        assert request.headers.getRawHeaders(b"x-team") == [b"blue"]
        assert request.authorization == "Bearer client"


def test_decode_response_headers_relayed_without_hop_by_hop() -> None:
    setup = Setup()
    setup.decode.extra_headers.update(
        {"X-Backend-Note": "from decode", "Keep-Alive": "timeout=5", "Upgrade": "h2c"}
    )
    # The client's request as it is: no client library adds headers of its own.
    answer = setup.post("/v1/completions", b'{"model": "m", "prompt": "x"}').answer()
    assert answer.values("x-backend-note") == ["from decode"]
    assert answer.values("keep-alive") == []
    assert answer.values("upgrade") == []
    assert answer.values("content-encoding") == []
    assert answer.values("content-type") == ["application/json"]


# -- the other routes ------------------------------------------------------------


def test_healthcheck_reports_configured_instances() -> None:
    setup = Setup(prefills=2, decodes=1)
    answer = setup.get("/healthcheck").answer()
    assert answer.status == 200
    report = answer.json()
    # The seed's three keys, as the seed has them.
    assert {k: report[k] for k in ("ready", "prefill_instances", "decode_instances")} == {
        "ready": True,
        "prefill_instances": 2,
        "decode_instances": 1,
    }
    assert [i["url"] for i in report["instances"]["prefill"]] == [p.url for p in setup.prefills]
    assert not report["draining"]
    assert setup.prefill.requests == []


def test_models_relayed_from_the_next_decode_instance() -> None:
    setup = Setup(decodes=2)
    for _ in range(4):
        answer = setup.get("/v1/models").answer()
        assert answer.status == 200
        assert answer.json()["data"][0]["id"] == "fake-model"
    assert [len(d.requests) for d in setup.decodes] == [2, 2]
    assert setup.prefill.requests == []


def test_tokenize_and_detokenize_go_to_a_decode_instance_as_they_are() -> None:
    setup = Setup(decodes=2)
    body = {"model": "m", "prompt": "x" * 40, "kv_transfer_params": {"do_remote_decode": True}}
    answer = setup.post("/tokenize", body).answer()
    assert answer.status == 200
    assert answer.json()["count"] == 10
    answer = setup.post("/detokenize", {"model": "m", "tokens": [1, 2]}).answer()
    assert (answer.status, answer.json()["prompt"]) == (200, "t1 t2")
    seen = [r for d in setup.decodes for r in d.requests]
    assert sorted(r.path for r in seen) == ["/detokenize", "/tokenize"]
    # The client's kv_transfer_params never reach a backend.
    assert all("kv_transfer_params" not in (r.body or {}) for r in seen)
    assert setup.prefill.requests == []


def test_a_tokenize_body_that_is_not_json_is_refused_before_any_backend() -> None:
    setup = Setup()
    assert_error(setup.post("/tokenize", b"{nope").answer(), 400, "invalid_json")
    assert setup.decode.requests == []


def test_a_dead_decode_is_retried_for_tokenize_too() -> None:
    setup = Setup(decodes=2, decode_retries=1)
    setup.proxy.stop_serving(setup.decodes[0])
    for _ in range(2):
        assert setup.post("/tokenize", {"model": "m", "prompt": "hi"}).answer().status == 200
    assert len(setup.decodes[1].requests) == 2
