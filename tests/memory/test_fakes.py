"""The fake vLLM itself, in memory: it must catch a proxy that gets the protocol wrong."""

from __future__ import annotations

import json
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import ensureDeferred

from nixl_twisted.testing import FakeVLLM, TransferLedger


def post(stub: StubTreq, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` to the fake behind ``stub``; its status and JSON answer."""
    answered: list[tuple[int, Any]] = []

    async def ask() -> None:
        response = await stub.post(url, json=body)  # type: ignore[attr-defined]
        answered.append((response.code, json.loads(await response.content())))

    ensureDeferred(ask())
    stub.flush()
    (answer,) = answered
    return answer


def test_decode_refuses_rebuilt_params_as_a_kv_load_failure() -> None:
    ledger = TransferLedger()
    prefill = FakeVLLM(name="fake-prefill", ledger=ledger)
    decode = FakeVLLM(name="fake-decode", ledger=ledger)
    to_prefill, to_decode = StubTreq(prefill.resource()), StubTreq(decode.resource())

    _, answer = post(
        to_prefill,
        "http://prefill/v1/completions",
        {"prompt": "a b c", "kv_transfer_params": {"do_remote_decode": True}},
    )
    params = answer["kv_transfer_params"]
    rebuilt = {k: params[k] for k in ("remote_engine_id", "remote_request_id")}
    rebuilt["do_remote_prefill"] = True
    code, answer = post(
        to_decode,
        "http://decode/v1/completions",
        {"prompt": "a b c", "kv_transfer_params": rebuilt},
    )
    assert code == 500
    assert "KV load failed" in answer["error"]["message"]

    code, _ = post(
        to_decode, "http://decode/v1/completions", {"prompt": "a b c", "kv_transfer_params": params}
    )
    assert code == 200
    assert [r.role for r in prefill.requests] == ["prefill"]
    assert [r.role for r in decode.requests] == ["decode", "decode"]


def test_a_subclass_of_the_fake_serves_its_own_handler() -> None:
    """The routes are made once for every fake; each call still finds the fake's own method."""

    class TokenizesNothing(FakeVLLM):
        def _tokenize(self, request: Any) -> bytes:
            return b'{"count": 0, "tokens": []}'

    status, answer = post(
        StubTreq(TokenizesNothing(name="custom").resource()),
        "http://fake/tokenize",
        {"prompt": "a b c"},
    )
    assert (status, answer) == (200, {"count": 0, "tokens": []})
