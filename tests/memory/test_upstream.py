"""What the backend client sends and takes: no cookie kept, gzip asked for and decoded."""

from __future__ import annotations

import json

import treq
from twisted.web.http_headers import Headers
from twisted.web.resource import EncodingResourceWrapper
from twisted.web.server import GzipEncoderFactory

from nixl_twisted.backends.upstream import BytesBody
from nixl_twisted.testing.memory import Answer
from tests.memory.support import FULL_CHAT, Setup


def test_a_backend_cookie_is_relayed_never_kept() -> None:
    setup = Setup(fake_options={"extra_headers": {"Set-Cookie": "session=abc; Path=/"}})
    # The client keeps no cookie either: any Cookie a backend sees is the proxy's.
    for _ in range(2):
        answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
        assert answer.status == 200
        assert answer.values("set-cookie") == ["session=abc; Path=/"]
    sent = [r.headers.getRawHeaders(b"cookie") for r in setup.prefill.requests]
    sent += [r.headers.getRawHeaders(b"cookie") for r in setup.decode.requests]
    assert sent == [None] * 4


# -- Accept-Encoding: every leg asks for gzip, whatever the client asked; the client gets identity


def ask(setup: Setup, accept_encoding: str | None) -> Answer:
    """POST the chat body with exactly this ``Accept-Encoding`` (or none)."""
    headers = {"Content-Type": "application/json"}
    if accept_encoding is not None:
        headers["Accept-Encoding"] = accept_encoding
    body = json.dumps(FULL_CHAT).encode("utf-8")
    return setup.proxy.request("POST", "/v1/chat/completions", body, headers).answer()


def test_the_client_encoding_is_not_forwarded_each_leg_asks_for_gzip() -> None:
    setup = Setup()
    for accepted in ("br", None):
        answer = ask(setup, accepted)
        assert (answer.status, answer.json()["object"]) == (200, "chat.completion")
    legs = [*setup.prefill.requests, *setup.decode.requests]
    assert [leg.headers.getRawHeaders(b"accept-encoding") for leg in legs] == [[b"gzip"]] * 4


def test_a_gzip_answer_is_decoded_and_the_client_gets_identity() -> None:
    setup = Setup()
    for fake in (setup.prefill, setup.decode):
        setup.proxy.serve(fake, EncodingResourceWrapper(fake.resource(), [GzipEncoderFactory()]))
    # The backends really answer gzip to what a leg asks for (a bare agent: no decoding).
    direct = setup.settle(
        setup.proxy.agent.request(
            b"POST",
            (setup.decode.url + "/v1/chat/completions").encode("ascii"),
            Headers({b"Content-Type": [b"application/json"], b"Accept-Encoding": [b"gzip"]}),
            BytesBody(json.dumps(FULL_CHAT).encode("utf-8")),
        )
    )
    setup.settle(treq.content(direct))
    assert direct.headers.getRawHeaders(b"content-encoding") == [b"gzip"]

    answer = ask(setup, "br")
    assert (answer.status, answer.json()["object"]) == (200, "chat.completion")
    assert answer.values("content-encoding") == []
    assert len(setup.ledger.redeemed) == 1
