"""A request's framing at the door, on a real channel in memory: what a backend could read
otherwise is refused before any leg (``nixl_twisted.web.framing``)."""

from __future__ import annotations

import pytest

from tests.memory.support import Setup

_POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
_BODY = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2}'


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def _refused(setup: Setup, raw: bytes) -> tuple[int, str, str]:
    """What the proxy answers ``raw``: (status, code, message); no backend was called."""
    client = setup.proxy.connect()
    client.send(raw)
    answer = client.answer()
    error = answer.json()["error"]
    assert client.transport.disconnecting
    assert setup.prefill.requests == [] and setup.decode.requests == []
    return answer.status, error["code"], error["message"]


@pytest.mark.parametrize(
    "encoding",
    [
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        b"Transfer-Encoding: chunked, identity\r\n",
        b"Transfer-Encoding: identity\r\n",
        b"Transfer-Encoding: gzip, chunked\r\n",
    ],
)
def test_a_transfer_encoding_other_than_chunked_alone_is_400(encoding: bytes) -> None:
    # Twisted read the first as chunked (its second header ignored) and the
    # third as no body at all: the body's bytes a second request.
    status, code, message = _refused(Setup(), _POST + encoding + b"\r\n" + _chunked(_BODY))
    assert (status, code) == (400, "malformed_request")
    assert "Transfer-Encoding" in message


def test_transfer_encoding_and_content_length_together_are_400() -> None:
    both = b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(_BODY)
    status, code, message = _refused(Setup(), _POST + both + _BODY)
    assert (status, code) == (400, "malformed_request")
    assert "given twice" in message


def test_a_chunked_body_is_still_served() -> None:
    setup = Setup()
    client = setup.proxy.connect()
    client.send(_POST + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(_BODY))
    assert client.answer().status == 200


def test_a_chunk_size_of_24_hex_digits_is_400_before_its_bytes() -> None:
    size = b"0" * 8 + b"f" * 16  # (24 digits; Twisted took it as a size)
    raw = _POST + b"Transfer-Encoding: chunked\r\n\r\n" + size + b"\r\nxx"
    status, code, message = _refused(Setup(), raw)
    assert (status, code) == (400, "malformed_request")
    assert "16 hex digits" in message


def test_a_chunk_larger_than_the_body_limit_is_413_at_its_size() -> None:
    raw = _POST + b"Transfer-Encoding: chunked\r\n\r\n%x\r\nxx" % (10**12)
    status, code, _ = _refused(Setup(max_body_size=1000), raw)
    assert (status, code) == (413, "request_too_large")


def test_more_headers_than_the_proxy_takes_are_431() -> None:
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(600))
    status, code, message = _refused(Setup(), b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + many)
    assert (status, code) == (431, "request_header_too_large")
    assert "more than 500 headers" in message


def test_headers_larger_than_the_proxy_takes_are_431() -> None:
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(20))
    status, code, _ = _refused(Setup(), b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + many)
    assert (status, code) == (431, "request_header_too_large")


@pytest.mark.parametrize("byte", [b"\x7f", b"\x01", b"\x1b"])
def test_a_header_value_with_a_control_byte_is_400(byte: bytes) -> None:
    raw = _POST + b"X-Note: a" + byte + b"b\r\nContent-Length: %d\r\n\r\n" % len(_BODY)
    status, code, message = _refused(Setup(), raw + _BODY)
    assert (status, code) == (400, "malformed_request")
    assert "control character" in message
