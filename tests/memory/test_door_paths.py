"""What the front door refuses before routing: a method's case, dot segments, encoded
``?``/``#``, an id no stored response has; nothing reaches a backend."""

from __future__ import annotations

import json

import pytest

from tests.memory.support import CHAT, Setup


def _asked(setup: Setup) -> list[str]:
    return [r.path for fake in (*setup.prefills, *setup.decodes) for r in fake.requests]


def test_a_lowercase_method_is_405_naming_the_routes_methods() -> None:
    # Werkzeug upper-cases the method it matches: ``post`` was served as POST.
    setup = Setup()
    answer = setup.proxy.request("post", "/v1/chat/completions", json.dumps(CHAT).encode()).answer()
    assert answer.status == 405
    assert answer.json()["error"]["code"] == "method_not_allowed"
    assert "case-sensitive" in answer.json()["error"]["message"]
    assert answer.headers["allow"] == "POST"
    assert _asked(setup) == []
    assert setup.proxy.request("get", "/nowhere").answer().status == 404


@pytest.mark.parametrize(
    "path",
    [
        "/v1/responses/..",
        "/v1/responses/%2e%2e",
        "/v1/responses/.",
        "/v1/responses/abc%3Fq=1",
        "/v1/responses/resp_1%23x",
        "/v1/responses/a%2F..%2F..",
    ],
)
def test_a_path_with_a_dot_segment_or_an_encoded_query_is_400(path: str) -> None:
    setup = Setup(decodes=2)
    answer = setup.proxy.request("GET", path).answer()
    assert answer.status == 400
    assert answer.json()["error"]["code"] == "invalid_url"
    assert _asked(setup) == []


@pytest.mark.parametrize("response_id", ["abc", "resp_", "resp_a.b", "resp_" + "a" * 129])
def test_an_id_no_stored_response_can_have_is_404_asking_no_decode(response_id: str) -> None:
    setup = Setup(decodes=2)
    for method, path in (
        ("GET", f"/v1/responses/{response_id}"),
        ("POST", f"/v1/responses/{response_id}/cancel"),
    ):
        answer = setup.proxy.request(method, path).answer()
        assert answer.status == 404, path
        assert answer.json()["error"]["code"] == "not_found"
        assert answer.headers["x-request-id"]
    assert _asked(setup) == []
