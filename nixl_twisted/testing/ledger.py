"""``TransferLedger``: the ``kv_transfer_params`` prefills issued, checked on decode.

In one process the ledger is a dict (``TransferLedger``); fakes in several
processes serving one fleet share a directory (``SharedLedger``): one file
per params issued, taken by an atomic rename when redeemed, so that any
decode of any process redeems what any prefill of any other issued.
"""

from __future__ import annotations

import hashlib
import json
import os
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
        self._keep(remote_request_id, params)
        return params

    def redeem(self, params: object) -> str | None:
        """Consume issued params; return why they cannot be loaded, or None."""
        if not isinstance(params, dict):
            return "kv_transfer_params is not an object"
        remote_request_id = str(params.get("remote_request_id"))
        issued = self._take(remote_request_id)
        if issued is None:
            return "no prefill issued these kv_transfer_params"
        if params != issued:
            self._keep(remote_request_id, issued)  # (still there for the right params)
            return "kv_transfer_params differ from what prefill issued"
        self.issued.pop(remote_request_id, None)
        self.redeemed.append(params)
        return None

    def _keep(self, remote_request_id: str, params: JSONObject) -> None:
        """(In one process, ``issued`` is the store.)"""
        self.issued[remote_request_id] = params

    def _take(self, remote_request_id: str) -> JSONObject | None:
        """The params issued under this id, taken out (None: none are)."""
        return self.issued.pop(remote_request_id, None)


class SharedLedger(TransferLedger):
    """A ledger in ``directory``, which fakes in other processes share.

    ``issued`` and ``redeemed`` say what this process's fakes issued and
    redeemed; the directory holds what is issued and not yet redeemed by any.
    """

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, remote_request_id: str) -> str:
        # (a client's id is no file name: its digest is)
        digest = hashlib.sha256(remote_request_id.encode("utf-8")).hexdigest()
        return os.path.join(self.directory, f"{digest}.json")

    def _keep(self, remote_request_id: str, params: JSONObject) -> None:
        path = self._path(remote_request_id)
        written = f"{path}.{os.getpid()}-{uuid.uuid4().hex}.tmp"
        with open(written, "w", encoding="utf-8") as file:
            json.dump(params, file)
        os.replace(written, path)  # whole, or not there: a reader never sees half

    def _take(self, remote_request_id: str) -> JSONObject | None:
        path = self._path(remote_request_id)
        taken = f"{path}.{os.getpid()}-{uuid.uuid4().hex}.taken"
        try:
            os.rename(path, taken)  # atomic: of two decodes, one takes it
        except FileNotFoundError:
            return None
        try:
            with open(taken, encoding="utf-8") as file:
                params: JSONObject = json.load(file)
        finally:
            os.unlink(taken)
        return params
