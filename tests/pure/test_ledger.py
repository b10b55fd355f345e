"""The fake's ledger: it must catch a proxy that gets the protocol wrong."""

from __future__ import annotations

import json
from pathlib import Path

from nixl_twisted.testing import SharedLedger, TransferLedger


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


def test_a_shared_ledger_redeems_in_one_what_another_issued_once(tmp_path: Path) -> None:
    """Two ledgers on one directory: two processes' fakes, one fleet."""
    issuing, redeeming = SharedLedger(str(tmp_path)), SharedLedger(str(tmp_path))
    params = issuing.issue("prefill-0", "r1", prompt_tokens=40, kv_port=5600)
    spoiled = dict(json.loads(json.dumps(params)), remote_port=1)
    assert redeeming.redeem(spoiled) == "kv_transfer_params differ from what prefill issued"
    assert redeeming.redeem(json.loads(json.dumps(params))) is None  # (still there for it)
    assert redeeming.redeemed == [params]
    assert redeeming.redeem(params) == "no prefill issued these kv_transfer_params"
    assert TransferLedger().redeem(params) == "no prefill issued these kv_transfer_params"
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_shared_ledger_names_its_files_by_digest_not_by_what_a_client_sent(
    tmp_path: Path,
) -> None:
    ledger = SharedLedger(str(tmp_path / "ledger"))
    hostile = {"remote_request_id": "../../etc/passwd"}
    assert ledger.redeem(hostile) == "no prefill issued these kv_transfer_params"
    ledger.issue("prefill-0", "../x", prompt_tokens=1, kv_port=1)
    (written,) = (tmp_path / "ledger").iterdir()
    assert written.suffix == ".json" and ".." not in written.name
