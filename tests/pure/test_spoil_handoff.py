"""The real check's man in the middle changes the params it is told to, and nothing else."""

from __future__ import annotations

import json

from bench.spoil_handoff import spoiled


def test_only_kv_transfer_params_are_changed() -> None:
    answer = {"id": "x", "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 5600}}
    raw = json.dumps(answer).encode()
    changed = json.loads(spoiled(raw, {"remote_port": 9}, ["do_remote_prefill"]))
    assert changed == {"id": "x", "kv_transfer_params": {"remote_port": 9}}
    for untouched in (b"not json", b"[1]", b'{"kv_transfer_params": null}'):
        assert spoiled(untouched, {"remote_port": 9}, []) is untouched
