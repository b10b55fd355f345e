"""The fake's ledger: it must catch a proxy that gets the protocol wrong."""

from __future__ import annotations

import json

from nixl_twisted.testing import TransferLedger


def test_redeem_accepts_exactly_what_was_issued_once() -> None:
    ledger = TransferLedger()
    params = ledger.issue("engine", "r1", prompt_tokens=40, kv_port=5600)
    assert ledger.redeem(json.loads(json.dumps(params))) is None
    assert ledger.redeem(params) == "no prefill issued these kv_transfer_params"


def test_redeem_refuses_params_missing_a_key() -> None:
    ledger = TransferLedger()
    params = dict(ledger.issue("engine", "r1", prompt_tokens=40, kv_port=5600))
    del params["remote_prefill_cached_tokens"]
    assert ledger.redeem(params) == "kv_transfer_params differ from what prefill issued"


def test_issued_params_look_like_current_vllm() -> None:
    params = TransferLedger().issue("engine", "r1", prompt_tokens=40, kv_port=5600)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[0, 1, 2], [100, 101, 102]]
    assert params["remote_request_id"].startswith("r1-")
    for key in ("tp_size", "transfer_mode", "remote_prefill_cached_tokens", "remote_num_tokens"):
        assert key in params
