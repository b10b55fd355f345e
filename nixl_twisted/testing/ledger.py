"""``TransferLedger``: the ``kv_transfer_params`` prefills issued, checked on decode."""

from __future__ import annotations

import uuid
from typing import Any

JSONObject = dict[str, Any]


class TransferLedger:
    """What prefills issued, so that decodes can check they got exactly that.

    Share one ledger between a fake prefill and a fake decode: a decode leg
    whose ``kv_transfer_params`` differ in any key (one dropped, one rebuilt)
    from what a prefill issued fails as a KV load does.
    """

    def __init__(self) -> None:
        self.issued: dict[str, JSONObject] = {}
        self.redeemed: list[JSONObject] = []

    def issue(
        self, engine_id: str, request_id: str, prompt_tokens: int, kv_port: int
    ) -> JSONObject:
        remote_request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        blocks = max(1, (prompt_tokens + 15) // 16)
        params: JSONObject = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            # One list of block ids per KV-cache group, as current vLLM sends.
            "remote_block_ids": [list(range(blocks)), list(range(100, 100 + blocks))],
            "remote_request_id": remote_request_id,
            "remote_host": "127.0.0.1",
            "remote_port": kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": prompt_tokens // 2,
            # A key that does not exist yet: a proxy must pass it on too.
            "x_future_key": {"nested": [1, [2, 3]], "flag": None},
        }
        self.issued[remote_request_id] = params
        return params

    def redeem(self, params: object) -> str | None:
        """Consume issued params; return why they cannot be loaded, or None."""
        if not isinstance(params, dict):
            return "kv_transfer_params is not an object"
        issued = self.issued.get(str(params.get("remote_request_id")))
        if issued is None:
            return "no prefill issued these kv_transfer_params"
        if params != issued:
            return "kv_transfer_params differ from what prefill issued"
        del self.issued[str(params["remote_request_id"])]
        self.redeemed.append(params)
        return None
