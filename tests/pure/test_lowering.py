"""The pure protocol: the seed's cases, and properties over any client body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nixl_twisted import ID, VERSION, meta
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.handoff import extract_kv_transfer_params
from nixl_twisted.protocol.lowering import (
    BatchRequest,
    batch_of,
    check_servable,
    decode_body,
    encode,
    new_request_id,
    parse_client_body,
    prefill_body,
    prompt_count,
)
from nixl_twisted.protocol.routes import CHAT_COMPLETIONS, COMPLETIONS

OWNED = {
    "kv_transfer_params",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
bodies = st.dictionaries(
    st.sampled_from(sorted(OWNED)) | st.text(max_size=12), json_values, max_size=10
)


def test_identity_is_byte_stable() -> None:
    # Recorded by users as evidence of which proxy produced a result.
    assert ID == "inferlab-vllm-nixl-proxy"
    assert VERSION == 4
    assert meta().id == ID
    assert meta().version == VERSION


def test_prefill_body_sets_nixl_prefill_transfer_params() -> None:
    # The seed's own case.
    body = {
        "model": "m",
        "prompt": "hello",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "min_tokens": 4,
    }
    lowered = prefill_body(body, "request-1")
    assert lowered["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": "xfer-request-1",
    }
    assert lowered["stream"] is False
    assert lowered["max_tokens"] == 1
    assert lowered["max_completion_tokens"] == 1
    assert "stream_options" not in lowered
    assert "min_tokens" not in lowered
    assert body["stream"] is True, "the client's body is not changed in place"


def test_max_completion_tokens_set_only_if_sent() -> None:
    lowered = prefill_body({"prompt": "x"}, "r")
    assert lowered["max_tokens"] == 1
    assert "max_completion_tokens" not in lowered


def test_decode_body_forwards_prefill_kv_transfer_params() -> None:
    params = {"remote_engine_id": "engine-p", "remote_host": "10.0.0.1", "remote_port": 5600}
    assert decode_body({"model": "m"}, params) == {"model": "m", "kv_transfer_params": params}


@given(bodies, st.text(min_size=1, max_size=40))
def test_prefill_lowering_keeps_every_field_it_does_not_own(body: dict[str, Any], rid: str) -> None:
    lowered = prefill_body(body, rid)
    for key, value in body.items():
        if key not in OWNED:
            assert lowered[key] == value
    assert set(lowered) - OWNED == set(body) - OWNED
    assert lowered["kv_transfer_params"]["transfer_id"] == f"xfer-{rid}"
    assert lowered["stream"] is False and lowered["max_tokens"] == 1
    assert ("max_completion_tokens" in lowered) == ("max_completion_tokens" in body)


@given(bodies, st.dictionaries(st.text(max_size=8), json_values, max_size=6))
def test_decode_body_is_client_body_plus_params_verbatim(
    body: dict[str, Any], params: dict[str, Any]
) -> None:
    completed = decode_body(body, params)
    assert completed["kv_transfer_params"] is params
    assert {k: v for k, v in completed.items() if k != "kv_transfer_params"} == {
        k: v for k, v in body.items() if k != "kv_transfer_params"
    }


@given(bodies)
def test_encode_round_trips(body: dict[str, Any]) -> None:
    assert parse_client_body(encode(body)) == body


def test_encode_keeps_non_ascii_as_utf8() -> None:
    assert encode({"prompt": "naïve 日本"}) == '{"prompt":"naïve 日本"}'.encode()


def test_a_lone_surrogate_from_the_client_is_sent_escaped() -> None:
    body = parse_client_body(b'{"prompt": "a\\ud800b"}')
    assert encode(body) == b'{"prompt":"a\\ud800b"}'
    assert parse_client_body(encode(body)) == body


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "invalid_json"),
        (b"{", "invalid_json"),
        (b'{"a": NaN}', "invalid_json"),
        (b'{"a": Infinity}', "invalid_json"),
        (b'{"a": 1e400}', "invalid_json"),
        (b'{"a": [{"b": -1E+999}]}', "invalid_json"),
        (b'{"a": 1%s.5}' % (b"0" * 400), "invalid_json"),
        (b"\xff", "invalid_json"),
        (b"[]", "invalid_body"),
        (b'"text"', "invalid_body"),
        (b"null", "invalid_body"),
    ],
)
def test_parse_client_body_refuses_with_400(raw: bytes, code: str) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_client_body(raw)
    assert caught.value.status == 400
    assert caught.value.code.value == code


@pytest.mark.parametrize(
    ("prompt", "count"),
    [
        ("one", 1),
        ([1, 2, 3], 1),
        (["one"], 1),
        ([[1, 2]], 1),
        (["a", "b"], 2),
        ([[1], [2], [3]], 3),
        (None, 1),
        ([], 1),
    ],
)
def test_prompt_count(prompt: object, count: int) -> None:
    assert prompt_count(prompt) == count


def test_batched_prompts_are_split_only_on_completions_and_bounded() -> None:
    assert batch_of(COMPLETIONS, {"prompt": ["a", "b"]}, 4) == BatchRequest(["a", "b"])
    assert batch_of(COMPLETIONS, {"prompt": [[1], [2]]}, 4) == BatchRequest([[1], [2]])
    assert batch_of(COMPLETIONS, {"prompt": "a"}, 4) is None
    assert batch_of(COMPLETIONS, {"prompt": [1, 2]}, 4) is None  # one token list
    assert batch_of(CHAT_COMPLETIONS, {"prompt": ["a", "b"]}, 4) is None
    with pytest.raises(ProxyError) as caught:
        batch_of(COMPLETIONS, {"prompt": ["a", "b", "c"]}, 2)
    assert (caught.value.status, caught.value.code) == (400, ErrorCode.TOO_MANY_PROMPTS)
    check_servable(COMPLETIONS, {"prompt": ["a", "b"]})


def test_a_batch_reads_the_fields_it_merges_by() -> None:
    body = {"prompt": ["a", "b"], "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    assert batch_of(COMPLETIONS, body, 4) == BatchRequest(["a", "b"], 2, True, True)
    nulls = {"prompt": ["a", "b"], "n": None, "stream": None, "stream_options": None}
    assert batch_of(COMPLETIONS, nulls, 4) == BatchRequest(["a", "b"])


@pytest.mark.parametrize(
    "field",
    [
        {"n": "x"},
        {"n": [1]},
        {"n": 1e400},
        {"n": 2.0},
        {"n": 0},
        {"n": True},
        {"stream": "false"},
        {"stream": 1},
        {"stream_options": "x"},
        {"stream_options": {"include_usage": "yes"}},
    ],
)
def test_a_batch_field_it_cannot_merge_by_is_a_400_naming_it(field: dict[str, object]) -> None:
    with pytest.raises(ProxyError) as caught:
        batch_of(COMPLETIONS, {"prompt": ["a", "b"], **field}, 4)
    assert (caught.value.status, caught.value.code) == (400, ErrorCode.INVALID_BATCH_FIELD)
    assert f"'{next(iter(field))}" in caught.value.message


def test_json_nested_past_the_recursion_limit_is_a_400() -> None:
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(ProxyError) as caught:
        parse_client_body(deep)
    assert (caught.value.status, caught.value.code) == (400, ErrorCode.JSON_TOO_DEEP)


def test_kv_transfer_params_extracted_verbatim() -> None:
    params = {"remote_block_ids": [[1, 2], [3]], "remote_prefill_cached_tokens": 7, "new": {}}
    raw = json.dumps({"id": "x", "kv_transfer_params": params}).encode()
    assert extract_kv_transfer_params(raw, "http://p") == params


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"<html>", "prefill_invalid_response"),
        (b'{"id": "x"}', "missing_kv_transfer_params"),
        (b"[1]", "missing_kv_transfer_params"),
        (b'{"kv_transfer_params": {"x": NaN}}', "prefill_invalid_response"),
        (b'{"kv_transfer_params": {"x": 1e400}}', "prefill_invalid_response"),
        (b'{"kv_transfer_params": null}', "invalid_kv_transfer_params"),
        (b'{"kv_transfer_params": [1]}', "invalid_kv_transfer_params"),
    ],
)
def test_unusable_prefill_answers_are_502(raw: bytes, code: str) -> None:
    with pytest.raises(ProxyError) as caught:
        extract_kv_transfer_params(raw, "http://p:1")
    assert caught.value.status == 502
    assert caught.value.code.value == code
    assert "http://p:1" in caught.value.message


def test_request_ids_are_fresh() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000


def test_a_tenants_priority_replaces_an_earlier_one_and_keeps_a_later_one() -> None:
    from nixl_twisted.protocol.lowering import with_priority

    chat = "/v1/chat/completions"
    assert with_priority(chat, {"model": "m"}, 5) == {"model": "m", "priority": 5}
    assert with_priority(chat, {"priority": -100}, 5) == {"priority": 5}  # never earlier
    assert with_priority(chat, {"priority": 9}, 5) == {"priority": 9}  # later: its own choice
    assert with_priority(chat, {"priority": "0"}, 5) == {"priority": 5}
    assert with_priority("/v1/responses", {}, 0) == {"priority": 0}
    assert with_priority("/v1/messages", {"max_tokens": 1}, 5) == {"max_tokens": 1}


def test_numbers_a_double_holds_are_kept_as_sent() -> None:
    raw = b'{"a": 1e308, "b": -1.5e-400, "c": %s, "d": 0.1}' % (b"9" * 400)
    body = parse_client_body(raw)
    assert body == {"a": 1e308, "b": -0.0, "c": int("9" * 400), "d": 0.1}
    assert parse_client_body(encode(body)) == body
