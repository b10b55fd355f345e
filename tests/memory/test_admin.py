"""Live backend changes: the admin API and pool updates, with requests in flight."""

from __future__ import annotations

import json
from typing import Any

from twisted.logger import formatEvent

from tests.memory.support import FULL_CHAT, Setup, sse_events

TOKEN = "admin-secret-token"
STREAM = dict(FULL_CHAT, stream=True)


def admin(
    setup: Setup,
    method: str,
    path: str,
    body: object | None = None,
    token: str | None = TOKEN,
    authorization: str | None = None,
) -> tuple[int, Any]:
    """``authorization``: the header's whole value, instead of ``Bearer`` and ``token``."""
    headers: dict[str, str] = {}
    if authorization is not None:
        headers["Authorization"] = authorization
    elif token:
        headers["Authorization"] = f"Bearer {token}"
    raw = json.dumps(body).encode() if body is not None else b""
    answer = setup.proxy.request(method, path, raw, headers).answer()
    return answer.status, answer.json()


def completion(setup: Setup) -> int:
    return setup.post("/v1/chat/completions", FULL_CHAT).answer().status


# -- who may use it --------------------------------------------------------------


def test_no_token_configured_means_no_admin_api() -> None:
    code, _ = admin(Setup(), "GET", "/admin/backends")
    assert code == 404


def test_missing_or_wrong_token_is_401_and_logged_without_the_token(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup(admin_token=TOKEN)
    for token in (None, "wrong-token"):
        code, answer = admin(setup, "GET", "/admin/backends", token=token)
        assert code == 401
        assert answer["error"]["code"] == "unauthorized"
    lines = [formatEvent(event) for event in logged]
    refusals = [line for line in lines if "admin API refused" in line]
    assert len(refusals) == 2
    assert not any("wrong-token" in line or TOKEN in line for line in lines)


def test_only_the_bearer_scheme_carries_the_token() -> None:
    setup = Setup(admin_token=TOKEN)
    for authorization, expected in (
        (f"Bearer {TOKEN}", 200),
        (f"bearer {TOKEN}", 200),  # a scheme is case-insensitive
        (f"BEARER   {TOKEN}", 200),  # one or more spaces
        (TOKEN, 401),
        (f"Basic {TOKEN}", 401),
        (f"Bearer{TOKEN}", 401),
        (f"Bearer {TOKEN}x", 401),
        ("Bearer ", 401),
    ):
        code, _ = admin(setup, "GET", "/admin/backends", authorization=authorization)
        assert code == expected, authorization


def test_the_right_token_lists_instances() -> None:
    setup = Setup(decodes=2, admin_token=TOKEN)
    code, answer = admin(setup, "GET", "/admin/backends")
    assert code == 200
    assert [i["url"] for i in answer["decode"]] == [d.url for d in setup.decodes]
    assert answer["prefill"][0]["in_flight"] == 0
    assert not answer["prefill"][0]["draining"]


# -- changes ---------------------------------------------------------------------


def test_add_then_remove_a_decode_instance() -> None:
    setup = Setup(admin_token=TOKEN)
    fresh = setup.new_fake("decode-new")
    code, added = admin(setup, "POST", "/admin/backends", {"pool": "decode", "url": fresh.url})
    assert (code, added["url"]) == (201, fresh.url)
    for _ in range(4):
        assert completion(setup) == 200
    assert (len(setup.decode.requests), len(fresh.requests)) == (2, 2)

    code, _ = admin(setup, "DELETE", "/admin/backends", {"pool": "decode", "url": fresh.url})
    assert code == 200
    for _ in range(2):
        assert completion(setup) == 200
    assert len(fresh.requests) == 2


def test_a_drained_instance_finishes_its_stream_then_leaves() -> None:
    setup = Setup(decodes=2, tokens=3, admin_token=TOKEN)
    busy, other = setup.decodes
    busy.hold_streams_after(1)
    held = busy.stream_held()
    client = setup.post("/v1/chat/completions", STREAM)  # goes to decode-0
    assert held.called

    code, drained = admin(
        setup, "POST", "/admin/backends/drain", {"pool": "decode", "url": busy.url}
    )
    assert (code, drained["draining"], drained["in_flight"]) == (202, True, 1)
    for _ in range(3):
        assert completion(setup) == 200
    assert (len(busy.requests), len(other.requests)) == (1, 3)
    _, listing = admin(setup, "GET", "/admin/backends")
    assert [i["url"] for i in listing["decode"]] == [busy.url, other.url]

    busy.release()
    setup.proxy.flush()
    assert sse_events(client)[-1] == "[DONE]"
    _, listing = admin(setup, "GET", "/admin/backends")
    assert [i["url"] for i in listing["decode"]] == [other.url]


def test_the_last_instance_cannot_be_taken_out() -> None:
    setup = Setup(admin_token=TOKEN)
    for method, path in (("DELETE", "/admin/backends"), ("POST", "/admin/backends/drain")):
        code, answer = admin(setup, method, path, {"pool": "decode", "url": setup.decode.url})
        assert (code, answer["error"]["code"]) == (409, "last_instance")
    assert completion(setup) == 200


def test_bad_changes_are_4xx() -> None:
    setup = Setup(admin_token=TOKEN)
    for body, status in (
        ({"pool": "decode", "url": "nope"}, 400),
        ({"pool": "cache", "url": "http://x:1"}, 400),
        ({"pool": "decode"}, 400),
    ):
        code, _ = admin(setup, "POST", "/admin/backends", body)
        assert code == status
    code, _ = admin(setup, "DELETE", "/admin/backends", {"pool": "decode", "url": "http://x:1"})
    assert code == 404


def test_a_change_that_is_not_strict_json_is_400_and_changes_nothing() -> None:
    setup = Setup(admin_token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    before = [i.url for i in setup.proxy.app.backends.decode.instances]
    for raw in (
        b'{"pool": "decode", "url": "http://x:1", "weight": 1e400}',
        b'{"pool": "decode", "url": "http://x:1", "weight": NaN}',
        b"[" * 100_000,
    ):
        answer = setup.proxy.request("POST", "/admin/backends", raw, headers).answer()
        assert answer.status == 400, answer.body
        assert answer.json()["error"]["code"] == "invalid_json"
    assert [i.url for i in setup.proxy.app.backends.decode.instances] == before


def test_a_url_with_cr_lf_is_refused_unstored_and_never_logged_raw(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup(admin_token=TOKEN)
    smuggled = f"{setup.decode.url}/\r\nX-Injected: 1"
    code, answer = admin(setup, "POST", "/admin/backends", {"pool": "decode", "url": smuggled})
    assert (code, answer["error"]["code"]) == (400, "invalid_url")
    assert "whitespace or control characters" in answer["error"]["message"]
    _, listing = admin(setup, "GET", "/admin/backends")
    assert [i["url"] for i in listing["decode"]] == [setup.decode.url]
    lines = [formatEvent(event) for event in logged]
    assert lines
    assert not [line for line in lines if "\r" in line or "\n" in line]


def test_an_instance_outside_the_allowed_backends_is_refused_and_never_added() -> None:
    setup = Setup(admin_token=TOKEN, allowed_backends=["10.0.0.0/8", "*.svc.cluster.local"])
    for url in ("http://192.168.0.9:8200", "http://evil.example:8200"):
        code, answer = admin(setup, "POST", "/admin/backends", {"pool": "decode", "url": url})
        assert (code, answer["error"]["code"]) == (403, "backend_not_allowed")
    code, answer = admin(
        setup, "POST", "/admin/backends", {"pool": "decode", "url": "http://10.1.2.3:8200"}
    )
    assert code == 201 and answer["source"] == "admin"
    _, listing = admin(setup, "GET", "/admin/backends")
    assert [i["url"] for i in listing["decode"]] == [setup.decode.url, "http://10.1.2.3:8200"]


def test_an_instance_whose_kv_events_are_outside_the_allowed_backends_is_refused() -> None:
    setup = Setup(admin_token=TOKEN, allowed_backends=["10.0.0.0/8"])
    for fragment in ("#kv-events=tcp://192.168.0.9:5557", "#kv-events=1&kv-replay=tcp://e.x:2"):
        body = {"pool": "prefill", "url": f"http://10.1.2.3:8100{fragment}"}
        code, answer = admin(setup, "POST", "/admin/backends", body)
        assert (code, answer["error"]["code"]) == (403, "backend_not_allowed")
        assert answer["error"]["message"].startswith("kv-"), answer  # says which endpoint
    body = {"pool": "prefill", "url": "http://10.1.2.3:8100#kv-events=tcp://10.9.9.9:5557"}
    code, answer = admin(setup, "POST", "/admin/backends", body)
    assert code == 201, answer


def test_the_metadata_address_is_never_added_unless_listed() -> None:
    setup = Setup(admin_token=TOKEN)
    body = {"pool": "decode", "url": "http://169.254.169.254:80"}
    code, answer = admin(setup, "POST", "/admin/backends", body)
    assert (code, answer["error"]["code"]) == (403, "backend_not_allowed")
    assert "metadata" in answer["error"]["message"]


# -- pool updates ----------------------------------------------------------------


def test_an_update_adds_new_and_drains_old_without_failing_in_flight() -> None:
    setup = Setup(tokens=3)
    fresh = setup.new_fake("decode-new")
    client = setup.held_stream()

    setup.proxy.service.backends.decode.update([fresh.url])
    for _ in range(3):
        assert completion(setup) == 200
    assert len(fresh.requests) == 3
    setup.decode.release()
    setup.proxy.flush()
    assert sse_events(client)[-1] == "[DONE]"
    assert setup.proxy.service.backends.decode.urls == (fresh.url,)
