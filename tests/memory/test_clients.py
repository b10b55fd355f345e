"""What a client may take: connections, time to send a request, its Host, 100-continue.

In memory, on the proxy's own ``Clock``: a deadline is reached by advancing
it, never by waiting.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyRequest
from werkzeug.exceptions import BadHost

from nixl_twisted.testing import InMemoryClient
from nixl_twisted.web.front import FrontDoor
from tests.memory.support import CHAT, Setup, error_code, status

COMPLETION = b'{"model": "m", "prompt": "hello"}'
CHAT_RAW = json.dumps(CHAT).encode()


def _post(body: bytes, host: bytes = b"Host: proxy\r\n", version: bytes = b"HTTP/1.1") -> bytes:
    return (
        b"POST /v1/completions "
        + version
        + b"\r\n"
        + host
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


def _slow(setup: Setup, raw: bytes) -> InMemoryClient:
    client = setup.proxy.connect()
    client.send(raw)
    return client


def test_a_request_head_that_takes_too_long_is_408_at_its_deadline() -> None:
    setup = Setup(header_timeout=10)
    loris = _slow(setup, b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n")
    silent = setup.proxy.connect()  # connected, sends nothing
    for _ in range(9):
        setup.proxy.advance(1)
        loris.send(b"X-A: b\r\n")  # a byte now and then does not reset the deadline
    assert not loris.lost and not silent.lost
    setup.proxy.advance(1)
    for client in (loris, silent):
        assert (status(client), error_code(client)) == (408, "header_timeout")
        assert client.lost
    assert setup.prefill.requests == []
    assert len(setup.proxy.service.site.channels()) == 0


def test_a_trickled_body_is_408_at_its_deadline_and_gives_its_bytes_back() -> None:
    setup = Setup(body_timeout=30, body_min_rate=1000)
    trickle = _slow(setup, _post(b"x" * 5000)[:-5000] + b"xx")
    for _ in range(29):
        setup.proxy.advance(1)
        trickle.send(b"x")  # 31 bytes in 30 s: 0.031 s of extension
    assert not trickle.lost
    setup.proxy.advance(1.1)
    assert (status(trickle), error_code(trickle)) == (408, "body_timeout")
    assert trickle.lost
    budget = setup.proxy.service.site.body_budget
    assert budget is not None and budget.held == 0


def test_a_body_at_a_fair_rate_earns_its_time() -> None:
    setup = Setup(body_timeout=2, body_min_rate=10)
    body = b'{"model": "m", "prompt": "' + b"x" * 40 + b'"}'  # 68 bytes: 6.8 s more
    client = _slow(setup, _post(body)[: -len(body)])
    for start in range(0, len(body), 10):
        setup.proxy.advance(0.9)  # 10 bytes every 0.9 s: above the minimum rate
        client.send(body[start : start + 10])
    assert status(client) == 200 and not client.lost


def _hog(setup: Setup, size: int, missing: int) -> InMemoryClient:
    """A body sent all at once but for its last ``missing`` bytes."""
    return _slow(setup, _post(b"x" * size)[:-missing])


def test_bodies_sent_almost_whole_then_trickled_hold_the_budget_one_window_at_most() -> None:
    setup = Setup(
        body_timeout=30,
        body_min_rate=1000,
        body_max_timeout=600,
        max_body_size=100_000,
        max_buffered_bodies=200_000,
    )
    # 99,990 bytes each: 100 s earned at 1,000 bytes a second, and the budget is theirs.
    hogs = [_hog(setup, 100_000, 10) for _ in range(2)]
    refused = _slow(setup, _post(COMPLETION))
    assert (status(refused), error_code(refused)) == (503, "request_bodies_buffer_full")
    for second in range(1, 60):
        setup.proxy.advance(1)
        if second % 20 == 0:
            for hog in hogs:
                hog.send(b"x")  # a byte now and then: under 1,000 bytes in 30 s
    assert not any(hog.lost for hog in hogs)  # (the first window brought its bytes)
    setup.proxy.advance(1)  # the end of the window they stalled in, long before 130 s
    for hog in hogs:
        assert (status(hog), error_code(hog)) == (408, "body_timeout")
        assert "stalled" in hog.answer().json()["error"]["message"]
        assert hog.lost
    budget = setup.proxy.service.site.body_budget
    assert budget is not None and budget.held == 0
    assert status(_slow(setup, _post(COMPLETION))) == 200


def test_no_body_takes_longer_than_the_ceiling_whatever_it_earned() -> None:
    setup = Setup(body_timeout=30, body_min_rate=1000, body_max_timeout=60, max_body_size=10**6)
    upload = _hog(setup, 10**6, 10**6 - 2000)
    for _ in range(59):
        setup.proxy.advance(1)
        upload.send(b"x" * 2000)  # twice the minimum rate: 2 s earned every second
    assert not upload.lost
    setup.proxy.advance(1)
    assert (status(upload), error_code(upload)) == (408, "body_timeout")
    assert "60 s at most" in upload.answer().json()["error"]["message"]
    assert upload.lost


def test_a_kept_alive_connection_waits_between_requests_without_a_head_deadline() -> None:
    setup = Setup(header_timeout=5)
    client = _slow(setup, _post(COMPLETION))
    assert status(client) == 200
    setup.proxy.advance(20)  # idle between requests: Twisted's idle timeout (60 s) applies
    assert not client.lost
    client.send(b"GET /healthcheck HTTP/1.1\r\n")  # a second request begins: 5 s from now
    setup.proxy.advance(5)
    assert client.lost and b"408 Request Timeout" in client.received()


def test_past_max_connections_a_new_one_is_503_at_once_until_one_closes() -> None:
    setup = Setup(max_connections=2)
    first, _second = setup.proxy.connect(), setup.proxy.connect()
    third = setup.proxy.connect()
    setup.proxy.flush()
    assert (status(third), error_code(third)) == (503, "too_many_connections")
    assert third.answer().headers["retry-after"] == "1"
    assert third.transport.disconnecting
    third.disconnect()
    first.disconnect()
    fourth = setup.proxy.connect()
    fourth.send(_post(COMPLETION))
    assert status(fourth) == 200


@pytest.mark.parametrize(
    ("host", "version"),
    [
        (b"", b"HTTP/1.1"),  # none
        (b"Host: a\r\nHost: b\r\n", b"HTTP/1.1"),  # two
        (b"Host: a\r\nHost: b\r\n", b"HTTP/1.0"),
        (b"Host: a b\r\n", b"HTTP/1.1"),
        (b"Host: a/b\r\n", b"HTTP/1.1"),
        (b"Host: a..b\r\n", b"HTTP/1.1"),
        (b"Host: " + b"a" * 64 + b".com\r\n", b"HTTP/1.1"),
        (b"Host: a:1:2\r\n", b"HTTP/1.1"),
        (b"Host: [zz]\r\n", b"HTTP/1.1"),
        (b"Host: \xc3\xa9.com\r\n", b"HTTP/1.1"),
        (b"Host: .\r\n", b"HTTP/1.1"),
    ],
)
def test_a_missing_duplicate_or_invalid_host_is_a_json_400(host: bytes, version: bytes) -> None:
    setup = Setup()
    client = _slow(setup, _post(COMPLETION, host, version))
    assert (status(client), error_code(client)) == (400, "invalid_host")
    assert setup.prefill.requests == []


@pytest.mark.parametrize(
    ("host", "version"),
    [
        (b"Host: proxy\r\n", b"HTTP/1.1"),
        (b"Host: proxy.example.com:8000\r\n", b"HTTP/1.1"),
        (b"Host: 10.0.0.1:80\r\n", b"HTTP/1.1"),
        (b"Host: [::1]:8000\r\n", b"HTTP/1.1"),
        (b"Host: xn--bcher-kva.example\r\n", b"HTTP/1.1"),
        (b"", b"HTTP/1.0"),  # HTTP/1.0 need not send one
    ],
)
def test_a_valid_host_is_served(host: bytes, version: bytes) -> None:
    setup = Setup()
    client = _slow(setup, _post(COMPLETION, host, version))
    assert status(client) == 200


def test_a_host_werkzeug_will_not_bind_is_a_json_400_too() -> None:
    # Werkzeug may refuse a name the syntax check let through (an IDNA rule):
    # its BadHost, raised before any route, is the same 400, not an HTML 500.
    class Unbindable(Resource):
        isLeaf = True

        def render(self, request: object) -> bytes:
            raise BadHost()

    request = DummyRequest([b""])
    request.path = b"/v1/completions"  # type: ignore[attr-defined]
    request.clientproto = b"HTTP/1.1"
    request.requestHeaders.setRawHeaders(b"host", [b"proxy"])
    body = FrontDoor(Unbindable()).render(request)  # type: ignore[arg-type]
    assert request.responseCode == 400
    assert isinstance(body, bytes) and json.loads(body)["error"]["code"] == "invalid_host"


def test_a_bad_host_on_the_messages_route_gets_anthropics_error_shape() -> None:
    setup = Setup()
    client = setup.proxy.connect()
    client.send(b"POST /v1/messages HTTP/1.1\r\nHost: a b\r\nContent-Length: 2\r\n\r\n{}")
    assert client.answer().status == 400
    assert client.answer().json()["type"] == "error"


#: A Messages request's body (the other client routes take ``COMPLETION``).
MESSAGE = b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    ("settings", "head", "twice", "same"),
    [
        (
            {"tenant_header": "X-Tenant"},
            b"POST /v1/completions",
            b"X-Tenant: a\r\nX-Tenant: b\r\n",
            b"X-Tenant: a\r\nx-tenant: a\r\n",
        ),
        (
            {},
            b"POST /v1/completions",
            b"Authorization: Bearer a\r\nauthorization: Bearer b\r\n",
            b"Authorization: Bearer a\r\nAuthorization: Bearer a\r\n",
        ),
        (
            {},
            b"POST /v1/messages",
            b"x-api-key: a\r\nX-Api-Key: b\r\n",
            b"x-api-key: a\r\nx-api-key: a\r\n",
        ),
        (  # with client keys: as the headers arrive, a valid key first or last
            {"api_key": ["sk-k"]},
            b"POST /v1/completions",
            b"Authorization: Bearer sk-k\r\nAuthorization: Bearer sk-other\r\n",
            b"Authorization: Bearer sk-k\r\nAuthorization: Bearer sk-k\r\n",
        ),
        (
            {"api_key": ["sk-k"]},
            b"POST /v1/completions",
            b"Authorization: Bearer sk-other\r\nAuthorization: Bearer sk-k\r\n",
            b"Authorization: Bearer sk-k\r\nAuthorization: Bearer sk-k\r\n",
        ),
        (  # the admin API took the last one
            {"admin_token": "t"},
            b"GET /admin/backends",
            b"Authorization: Bearer wrong\r\nAuthorization: Bearer t\r\n",
            b"Authorization: Bearer t\r\nAuthorization: Bearer t\r\n",
        ),
    ],
)
def test_a_header_that_says_who_the_client_is_sent_twice_differently_is_a_400(
    settings: dict[str, Any], head: bytes, twice: bytes, same: bytes
) -> None:
    """No first-wins or last-wins rule a gateway adding its own value could be fooled by."""
    setup = Setup(**settings)
    body = MESSAGE if head.endswith(b"messages") else COMPLETION
    for headers, answered in ((twice, 400), (same, 200)):
        client = _slow(
            setup,
            head
            + b" HTTP/1.1\r\nHost: proxy\r\n"
            + headers
            + b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
        )
        assert status(client) == answered, client.received()
        if answered == 400:
            error = client.answer().json()["error"]
            assert error.get("code", "conflicting_headers") == "conflicting_headers"  # (Anthropic:
            assert error["type"] == "invalid_request_error"  # no code, the same type)
            name = headers.split(b":", 1)[0].decode()
            message = f"the request sends {name} more than once, with different values"
            assert message.lower() in client.received().decode().lower()
            assert setup.prefill.requests == [] and setup.decode.requests == []


def test_no_100_continue_follows_a_413() -> None:
    setup = Setup(max_body_size=100)
    client = _slow(
        setup,
        b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nExpect: 100-continue\r\n"
        b"Content-Length: 1000\r\n\r\n",
    )
    assert client.received().startswith(b"HTTP/1.1 413 ")
    assert b"100 Continue" not in client.received()
    assert client.transport.disconnecting


def test_a_body_within_the_limit_gets_its_100_continue() -> None:
    setup = Setup()
    client = _slow(
        setup,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nExpect: 100-continue\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(CHAT_RAW),
    )
    assert client.received() == b"HTTP/1.1 100 Continue\r\n\r\n"
    client.send(CHAT_RAW)
    answer = client.received().removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")
    (prefill_leg,) = setup.prefill.requests
    assert prefill_leg.headers.getRawHeaders(b"expect") is None


def _unkeyed(setup: Setup, head: bytes) -> InMemoryClient:
    """A request's head with no client key; the proxy answers it 401 at once."""
    client = _slow(setup, b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n" + head + b"\r\n")
    answer = client.answer()
    assert (answer.status, answer.json()["error"]["code"]) == (401, "invalid_api_key")
    return client


def test_without_a_key_the_body_is_read_and_dropped_after_the_401_then_closed() -> None:
    setup = Setup(api_key=["sk-k"], max_body_size=1000)
    client = _unkeyed(setup, b"Content-Length: 600\r\n")
    client.send(b"x" * 599)
    assert not client.transport.disconnecting  # still sending: closing now would reset it
    client.send(b"x")
    assert client.transport.disconnecting
    assert setup.prefill.requests == [] and setup.decode.requests == []
    assert setup.proxy.service.site.body_budget.held == 0


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"Expect: 100-continue\r\nContent-Length: 600\r\n", id="waits-for-100"),
        pytest.param(b"Content-Length: 5000\r\n", id="past-the-limit"),
    ],
)
def test_without_a_key_closed_at_once_when_no_body_is_worth_waiting_for(head: bytes) -> None:
    setup = Setup(api_key=["sk-k"], max_body_size=1000)
    client = _unkeyed(setup, head)
    assert client.transport.disconnecting
    assert b"100 Continue" not in client.received()


def test_a_dropped_chunked_body_is_closed_past_the_body_limit() -> None:
    setup = Setup(api_key=["sk-k"], max_body_size=1000)
    client = _unkeyed(setup, b"Transfer-Encoding: chunked\r\n")
    chunk = b"%x\r\n%s\r\n" % (600, b"x" * 600)
    client.send(chunk)
    assert not client.transport.disconnecting
    client.send(chunk)
    assert client.transport.disconnecting


def test_a_dropped_body_that_stalls_is_closed_at_its_deadline_with_no_second_answer() -> None:
    setup = Setup(api_key=["sk-k"], body_timeout=30, body_min_rate=0)
    client = _unkeyed(setup, b"Content-Length: 600\r\n")
    written = client.received()
    client.send(b"x" * 10)
    setup.proxy.advance(29)
    assert not client.transport.disconnecting
    setup.proxy.advance(2)
    assert client.transport.disconnecting
    assert client.received() == written  # the 401 alone: no 408 after it
