"""Header rules in both directions."""

from __future__ import annotations

from twisted.web.http_headers import Headers

from nixl_twisted.protocol.headers import (
    IDENTITY,
    backend_request_headers,
    client_response_headers,
    conflicting,
    request_id_of,
)


def client(**headers: str) -> Headers:
    return Headers({k.replace("_", "-").encode(): [v.encode()] for k, v in headers.items()})


def test_hop_by_hop_and_proxy_owned_request_headers_are_not_forwarded() -> None:
    sent = backend_request_headers(
        client(
            connection="close, x-private",
            x_private="1",
            te="trailers",
            upgrade="h2c",
            proxy_authorization="Basic x",
            host="proxy:8000",
            content_length="12",
            accept_encoding="br",
            x_request_id="theirs",
            x_data_parallel_rank="3",
            expect="100-continue",
            user_agent="openai-python",
        ),
        "r-1",
        None,
    )
    assert dict(sent.getAllRawHeaders()) == {
        b"Content-Type": [b"application/json"],
        b"X-Request-Id": [b"r-1"],
    }


def test_only_the_key_trace_context_and_named_headers_are_forwarded() -> None:
    # Forwarded, X-Forwarded-For, Cookie and Range reached both legs.
    sent = backend_request_headers(
        client(
            authorization="Bearer c",
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            tracestate="v=1",
            baggage="k=v",
            forwarded="for=203.0.113.9",
            x_forwarded_for="203.0.113.9",
            cookie="session=1",
            range="bytes=0-1",
            x_tenant_note="kept",
            x_other="dropped",
            host="named:1",
        ),
        "r-1",
        None,
        forwarded=("X-Tenant-Note", "Host", "Connection"),
    )
    assert {name.lower() for name, _ in sent.getAllRawHeaders()} == {
        b"authorization",
        b"traceparent",
        b"tracestate",
        b"baggage",
        b"x-tenant-note",
        b"content-type",
        b"x-request-id",
    }


def test_client_authorization_wins_over_the_operator_key() -> None:
    sent = backend_request_headers(client(authorization="Bearer c"), "r", "op")
    assert sent.getRawHeaders(b"authorization") == [b"Bearer c"]


def test_operator_key_sent_when_client_has_none() -> None:
    sent = backend_request_headers(client(), "r", "op")
    assert sent.getRawHeaders(b"authorization") == [b"Bearer op"]


def test_no_content_type_on_a_get() -> None:
    sent = backend_request_headers(client(), "r", None, json_body=False)
    assert sent.getRawHeaders(b"content-type") is None


def test_response_headers_keep_end_to_end_ones_only() -> None:
    kept = client_response_headers(
        client(
            connection="keep-alive, x-conn",
            x_conn="1",
            keep_alive="timeout=5",
            transfer_encoding="chunked",
            content_type="text/event-stream",
            x_request_id="abc",
            content_encoding="",
        )
    )
    assert dict(kept.getAllRawHeaders()) == {b"Content-Type": [b"text/event-stream"]}


def test_a_real_content_encoding_is_kept() -> None:
    kept = client_response_headers(client(content_encoding="gzip"))
    assert kept.getRawHeaders(b"content-encoding") == [b"gzip"]


def test_a_clients_request_id_is_kept_when_it_is_one_sane_token() -> None:
    for sane in ("req-42", "0b8f6c1e-7d1a-4c5e-9f3b-2a6d8e0c4b71", "gw:trace.01", "x" * 128):
        assert request_id_of(client(x_request_id=sane)) == sane
    repeated = Headers({b"X-Request-Id": [b"same", b"same"]})
    assert request_id_of(repeated) == "same"


def test_any_other_request_id_is_replaced_by_a_fresh_one() -> None:
    insane = [
        Headers(),
        Headers({b"X-Request-Id": [b""]}),
        Headers({b"X-Request-Id": [b"x" * 129]}),
        Headers({b"X-Request-Id": [b"two words"]}),
        Headers({b"X-Request-Id": [b"a\x1b[31m"]}),
        Headers({b"X-Request-Id": [b"a/b"]}),
        Headers({b"X-Request-Id": ["caf\u00e9".encode()]}),
        Headers({b"X-Request-Id": [b"mine", b"yours"]}),  # (which would be the client's?)
    ]
    fresh = {request_id_of(headers) for headers in insane}
    assert len(fresh) == len(insane)
    assert all(len(one) == 32 and int(one, 16) >= 0 for one in fresh)  # (uuid4's hex)


def test_an_identity_header_conflicts_only_with_a_different_value_of_itself() -> None:
    names = (*IDENTITY, b"X-Tenant")
    assert conflicting(Headers({b"x-tenant": [b"a", b"b"]}), names) == b"X-Tenant"
    assert conflicting(Headers({b"authorization": [b"Bearer a", b"Bearer b"]}), names) == (
        b"Authorization"
    )
    assert conflicting(Headers({b"x-tenant": [b"a", b"a"]}), names) is None  # (one value)
    assert conflicting(Headers({b"authorization": [b"k"], b"x-api-key": [b"j"]}), names) is None
    assert conflicting(Headers({b"x-other": [b"a", b"b"]}), names) is None  # (not identity)
