"""The Klein app and its routes in memory: no socket, fakes behind RequestTraversalAgent."""

from __future__ import annotations

import json

import pytest
from treq.testing import StubTreq
from twisted.internet.defer import ensureDeferred

from nixl_twisted.backends.capacity import COOL
from nixl_twisted.testing import FakeVLLM, InMemoryProxy, TransferLedger
from tests.memory.support import CHAT, STREAM, Setup, error_code, status


def test_a_completion_goes_through_both_legs() -> None:
    setup = Setup()
    client = setup.post("/v1/chat/completions", CHAT)
    assert status(client) == 200
    assert client.answer().json()["object"] == "chat.completion"
    assert [r.role for r in setup.prefill.requests] == ["prefill"]
    assert [r.role for r in setup.decode.requests] == ["decode"]
    assert len(setup.ledger.redeemed) == 1


def test_models_is_one_leg_and_gives_its_instance_back() -> None:
    setup = Setup()
    client = setup.proxy.request("GET", "/v1/models")
    assert status(client) == 200
    assert client.answer().json()["data"][0]["id"] == "fake-model"
    (decode,) = setup.proxy.service.backends.decode.instances
    assert decode.in_flight == 0  # the lease ended with the relay


def test_models_tries_the_next_decode_instance_when_one_is_unreachable() -> None:
    ledger = TransferLedger()
    live = FakeVLLM(name="decode-live", ledger=ledger)
    proxy = InMemoryProxy([FakeVLLM(name="prefill-0", ledger=ledger)], [live], decode_retries=1)
    (dead,) = proxy.service.backends.decode.add("http://dead.invalid:1")
    proxy.service.backends.decode.instances.reverse()  # the dead one comes first
    client = proxy.request("GET", "/v1/models")
    assert status(client) == 200
    assert dead.failures == 1 and dead.in_flight == 0  # one of the three that mark it down
    assert len(live.requests) == 1


@pytest.mark.parametrize("raised", [False, True], ids=["failed", "raised"])
@pytest.mark.parametrize(
    ("role", "path", "body"),
    [
        ("prefill", "/v1/chat/completions", CHAT),
        ("decode", "/v1/chat/completions", CHAT),
        ("decode", "/v1/chat/completions", STREAM),
        ("decode", "/v1/models", None),
        ("decode", "/tokenize", {"model": "m", "prompt": "hi"}),
    ],
)
def test_any_error_connecting_ends_the_leg_as_unreachable(
    role: str, path: str, body: object, raised: bool
) -> None:
    """Not only refusals and DNS: whatever connecting raises (here what an
    unloadable idna codec does), returned as a failure or raised at once."""
    setup = Setup()
    fake = setup.prefill if role == "prefill" else setup.decode
    setup.proxy.break_connections(fake, LookupError("unknown encoding: idna"), raised)
    client = setup.proxy.request("GET", path) if body is None else setup.post(path, body)
    assert (status(client), error_code(client)) == (502, f"{role}_unreachable")
    said = client.answer().json()["error"]["message"]
    assert said == f"a {role} instance could not be reached"  # (no address, no cause)
    (instance,) = getattr(setup.proxy.service.backends, role).instances
    assert (instance.failures, instance.in_flight) == (1, 0)
    assert "unknown encoding: idna" in str(instance.last_error)  # (the operator's view)


def test_a_body_that_is_not_json_is_refused_before_any_backend() -> None:
    setup = Setup()
    client = setup.proxy.request("POST", "/v1/completions", b"{nope", {"Content-Type": "x"})
    assert (status(client), error_code(client)) == (400, "invalid_json")
    assert setup.prefill.requests == []


def test_prefill_4xx_is_relayed_and_no_decode_is_sent() -> None:
    setup = Setup()
    setup.prefill.refuse_next(400, "max_tokens is too large")
    client = setup.post("/v1/completions", {"model": "m", "prompt": "x"})
    assert status(client) == 400
    assert client.answer().json()["error"]["message"] == "max_tokens is too large"
    assert setup.decode.requests == []


def test_prefill_503_is_retried_on_the_next_instance_which_counts_as_full_a_moment() -> None:
    ledger = TransferLedger()
    busy = FakeVLLM(name="prefill-busy", ledger=ledger)
    spare = FakeVLLM(name="prefill-spare", ledger=ledger)
    decode = FakeVLLM(name="decode-0", ledger=ledger)
    proxy = InMemoryProxy([busy, spare], [decode], unhealthy_threshold=1)
    busy.crash_next(503, "overloaded")
    client = proxy.request(
        "POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x"}).encode()
    )
    assert status(client) == 200
    assert [len(busy.requests), len(spare.requests)] == [1, 1]
    first, second = proxy.service.backends.prefill.instances
    # vLLM's engine queue was full: not a failure, but no leg goes there for a moment.
    assert (first.healthy, second.healthy) == (True, True)
    assert (first.in_flight, second.in_flight) == (0, 0)
    assert first.full_until == proxy.clock.seconds() + COOL
    for _ in range(2):
        again = proxy.request("POST", "/v1/completions", b'{"model": "m", "prompt": "x"}')
        assert status(again) == 200
    assert [len(busy.requests), len(spare.requests)] == [1, 3]
    proxy.advance(COOL)
    again = proxy.request("POST", "/v1/completions", b'{"model": "m", "prompt": "x"}')
    assert status(again) == 200 and len(busy.requests) == 2  # its turn again


def test_unknown_paths_and_methods_get_openai_errors_through_stub_treq() -> None:
    setup = Setup()
    stub = StubTreq(setup.proxy.app.resource())
    get = stub.get  # type: ignore[attr-defined]  # StubTreq makes its verbs at run time

    async def ask() -> None:
        missing = await get("http://proxy/v2/nothing")
        assert missing.code == 404
        assert json.loads(await missing.content())["error"]["code"] == "not_found"
        # An empty segment is no route either (Werkzeug would answer a 308 with no Location).
        doubled = await get("http://proxy/v1//models")
        assert doubled.code == 404
        assert json.loads(await doubled.content())["error"]["code"] == "not_found"
        wrong = await get("http://proxy/v1/completions")
        assert wrong.code == 405
        assert wrong.headers.getRawHeaders(b"allow") == [b"POST"]
        health = await get("http://proxy/healthcheck")
        report = json.loads(await health.content())
        assert (health.code, report["ready"], report["prefill_instances"]) == (200, True, 1)

    done = ensureDeferred(ask())
    stub.flush()
    assert done.called and done.result is None, done.result


def test_malformed_http_gets_the_openai_error_body() -> None:
    # Through the private hook HTTPChannel._respondToBadRequestAndDisconnect
    # (docs/architecture.md): if Twisted renames it, this answer loses its body.
    setup = Setup()
    client = setup.proxy.connect()
    client.send(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
    answer = client.answer()
    assert (answer.status, answer.json()["error"]["code"]) == (400, "malformed_request")
    assert client.lost


def _head(length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % length
    )


def _body(length: int) -> bytes:
    """A completion body of exactly ``length`` bytes."""
    start, end = b'{"model": "m", "prompt": "', b'"}'
    return start + b"x" * (length - len(start) - len(end)) + end


def test_slow_uploads_hold_only_the_bytes_they_sent() -> None:
    setup = Setup(max_body_size=1000, max_buffered_bodies=1500)
    for _ in range(2):  # each announces 1,000 bytes and sends 12
        setup.proxy.connect().send(_head(1000) + _body(1000)[:12])
    other = setup.proxy.connect()
    other.send(_head(1000) + _body(1000))
    assert other.answer().status == 200
    assert setup.proxy.service.site.body_budget.held == 24  # type: ignore[union-attr]


def test_past_the_bodies_buffer_503_as_the_bytes_arrive_until_one_ends() -> None:
    setup = Setup(max_body_size=1000, max_buffered_bodies=1500)
    slow = setup.proxy.connect()
    slow.send(_head(1000) + _body(1000)[:900])  # 900 bytes held
    busy = setup.proxy.connect()
    busy.send(_head(700))
    assert busy.received() == b""  # nothing held yet, nothing refused
    busy.send(_body(700)[:300])  # 1,200: held
    busy.send(_body(700)[300:])  # 1,600 > 1,500: refused as it arrives
    answer = busy.answer()
    assert (answer.status, answer.json()["error"]["code"]) == (503, "request_bodies_buffer_full")
    assert answer.headers["retry-after"] == "1"
    assert setup.prefill.requests == [] and busy.transport.disconnecting

    slow.send(_body(1000)[900:])
    assert slow.answer().status == 200  # its bytes are given back as it ends
    later = setup.proxy.connect()
    later.send(_head(600) + _body(600))
    assert later.answer().status == 200
    assert setup.proxy.service.site.body_budget.held == 0  # type: ignore[union-attr]
