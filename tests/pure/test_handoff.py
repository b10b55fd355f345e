"""The handoff checked: what decode's NixlConnector needs from prefill's params, and no less."""

from __future__ import annotations

from typing import Any

import pytest

from nixl_twisted.protocol.handoff import BadHandoff, check_handoff

#: What vLLM 0.32's prefill answered on this machine (p4), one prompt of two tokens.
REAL = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[2438]],
    "remote_engine_id": "1642ee63-23ac-4557-8b00-6dfed16e6d92",
    "remote_request_id": "cmpl-b549421559b60e34-0-96032e88",
    "remote_host": "127.0.0.1",
    "remote_port": 5614,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 2,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}


def changed(**changes: Any) -> dict[str, Any]:
    params = dict(REAL)
    for key, value in changes.items():
        if value is ...:
            del params[key]
        else:
            params[key] = value
    return params


@pytest.mark.parametrize(
    "params",
    [
        REAL,
        changed(remote_block_ids=[1, 2, 3]),  # one group, flat, as before vLLM's HMA
        changed(remote_request_id=..., tp_size=...),  # older vLLM: decode does without
        changed(remote_block_ids=[], remote_num_tokens=0),  # nothing computed, said so
        changed(x_future_key={"a": [1]}),
    ],
)
def test_params_decode_can_pull_with_pass(params: dict[str, Any]) -> None:
    check_handoff(params)


@pytest.mark.parametrize(
    ("params", "problem", "said"),
    [
        (changed(do_remote_prefill=False), "not_remote_prefill", "do_remote_prefill"),
        (changed(do_remote_prefill=...), "not_remote_prefill", "do_remote_prefill"),
        (changed(remote_engine_id=...), "missing_key", "remote_engine_id"),
        (changed(remote_host=None), "missing_key", "remote_host"),
        (changed(remote_port=...), "missing_key", "remote_port"),
        (changed(remote_block_ids=...), "missing_key", "remote_block_ids"),
        (changed(remote_host=""), "bad_value", "remote_host"),
        (changed(remote_port=0), "bad_value", "remote_port"),
        (changed(remote_port=70000), "bad_value", "remote_port"),
        (changed(remote_port="5614"), "bad_value", "remote_port"),
        (changed(remote_port=True), "bad_value", "remote_port"),
        (changed(remote_engine_id=7), "bad_value", "remote_engine_id"),
        (changed(remote_request_id=""), "bad_value", "remote_request_id"),
        (changed(tp_size=0), "bad_value", "tp_size"),
        (changed(remote_block_ids="1,2"), "bad_value", "remote_block_ids"),
        (changed(remote_block_ids=[[1], ["2"]]), "bad_value", "remote_block_ids"),
        (changed(remote_block_ids=[]), "no_blocks", "empty"),
        (changed(remote_block_ids=[[], []]), "no_blocks", "empty"),
        (changed(remote_block_ids=[[]], remote_num_tokens=...), "no_blocks", "empty"),
    ],
)
def test_params_decode_would_recompute_with_are_refused(
    params: dict[str, Any], problem: str, said: str
) -> None:
    with pytest.raises(BadHandoff) as refused:
        check_handoff(params)
    assert refused.value.problem == problem
    assert said in str(refused.value)
