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


#: What vLLM 0.34's prefill answers (``nixl/pull_scheduler.py``,
#: ``NixlPullConnectorScheduler.request_finished``): one block list per KV-cache group
#: (``connector.py``'s ``request_finished`` wraps a single group's list), the lease's
#: ``remote_blocks_expiry_time`` None on prefill, and ``remote_registration_generation``.
REAL_034 = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[17, 18, 19]],
    "remote_engine_id": "a4a0c5d6-6f0e-4d77-9a8e-3c1c9d1e2f00",
    "remote_request_id": "chatcmpl-9f1c2d3e4b5a6978-0-1a2b3c4d",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 300,
    "remote_blocks_expiry_time": None,
    "remote_registration_generation": 3,
    "transfer_mode": "pull",
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
        REAL_034,
        # 0.34, a hybrid model: a sliding-window group clipped to its in-window tail
        # (``base_scheduler.py``, ``get_exchange_clipped_blocks``), one group emptied.
        dict(REAL_034, remote_block_ids=[[17, 18, 19], [19], []]),
        # 0.34, nothing to hold (``delay_free_blocks`` false): the unclipped, empty groups.
        dict(REAL_034, remote_block_ids=[[]], remote_num_tokens=0),
        dict(REAL_034, remote_block_ids=[[], []], remote_num_tokens=0),
        # 0.34 push mode (``push_scheduler.py``, ``request_finished``): no lease expiry,
        # no registration generation, ``transfer_mode: push``.
        {
            key: value
            for key, value in dict(REAL_034, transfer_mode="push").items()
            if key not in ("remote_blocks_expiry_time", "remote_registration_generation")
        },
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
