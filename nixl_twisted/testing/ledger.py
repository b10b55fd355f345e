"""``TransferLedger``: the ``kv_transfer_params`` prefills issued, checked on decode,
and the handles decodes issued (bidirectional transfer), read by prefills.

In one process the ledger is dicts (``TransferLedger``); fakes in several
processes serving one fleet share a directory (``SharedLedger``): one file
per params issued, taken by an atomic rename when redeemed, so that any
decode of any process redeems what any prefill of any other issued.

A decode's handle (``issue_handle``) keeps the token ids decode held and
when its blocks expire, on decode's clock; a prefill reads it once
(``read_handle``), as vLLM does not check: a handle read again, or read
for a prompt that does not extend what decode held, is read all the
same, and the params that prefill issues then carry KV that is wrong
(``issue(wrong_kv=True)``): the decode that redeems them says so
(``wrong_kv``) and answers other tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

JSONObject = dict[str, Any]

#: Why a handle cannot be read (a KV-load failure on prefill).
UNKNOWN_HANDLE = "no decode issued this handle"
EXPIRED_HANDLE = "the handle's blocks expired on decode"


@dataclass(frozen=True)
class HandleRead:
    """What a prefill read through a decode's handle."""

    #: The token ids decode held (empty when ``problem`` says why nothing was read).
    held: list[int]
    #: Why nothing could be read (``UNKNOWN_HANDLE``, ``EXPIRED_HANDLE``), or None.
    problem: str | None = None
    #: It had been read before: its blocks are no longer what it names.
    again: bool = False


def _blocks(tokens: int) -> list[list[int]]:
    """Block ids for ``tokens`` tokens: one list per KV-cache group, as current vLLM sends."""
    count = max(1, (tokens + 15) // 16)
    return [list(range(count)), list(range(100, 100 + count))]


class TransferLedger:
    """What prefills issued, so that decodes can check they got exactly that.

    Share one ledger between a fake prefill and a fake decode: a decode leg
    whose ``kv_transfer_params`` differ in any key (one dropped, one rebuilt)
    from what a prefill issued fails as a KV load does. With bidirectional
    transfer, it also keeps decodes' handles (``issue_handle``), read once by
    prefills (``read_handle``).
    """

    def __init__(self) -> None:
        self.issued: dict[str, JSONObject] = {}
        self.redeemed: list[JSONObject] = []
        #: Everything but ``issued``, by kind: decodes' handles ("handle", then "read"
        #: once read) and the params whose KV is wrong ("wrong").
        self._stores: dict[str, dict[str, JSONObject]] = {"handle": {}, "read": {}, "wrong": {}}

    def issue(
        self,
        engine_id: str,
        request_id: str,
        prompt_tokens: int,
        kv_port: int,
        wrong_kv: bool = False,
    ) -> JSONObject:
        """Params for a prefill's KV (``wrong_kv``: KV its decode must not trust)."""
        remote_request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        params: JSONObject = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_block_ids": _blocks(prompt_tokens),
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
        if wrong_kv:
            self._keep(remote_request_id, {}, "wrong")
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

    def wrong_kv(self, params: object) -> bool:
        """The KV behind these (redeemed) params is wrong: prefill read a stale handle."""
        if not isinstance(params, dict):
            return False
        return self._take(str(params.get("remote_request_id")), "wrong") is not None

    def issue_handle(
        self,
        engine_id: str,
        request_id: str,
        held: Sequence[int],
        kv_port: int,
        expires: float,
    ) -> JSONObject:
        """A decode's handle on the blocks of ``held`` (its prompt and output ids), pinned
        until ``expires`` on decode's clock; the last token has no KV yet."""
        remote_request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        tokens = len(held) - 1
        handle: JSONObject = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": _blocks(tokens),
            "remote_engine_id": engine_id,
            "remote_request_id": remote_request_id,
            "remote_host": "127.0.0.1",
            "remote_port": kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": expires,
            "transfer_mode": "pull",
            "remote_registration_generation": 0,
        }
        record = {"handle": handle, "held": list(held), "expires": expires}
        self._keep(remote_request_id, record, "handle")
        return handle

    def read_handle(self, params: object, now: float) -> HandleRead:
        """Read what a handle names at ``now`` (the clock it expires on), once: a second
        read finds it, read before (``again``); an expired one, or one no decode issued,
        is not read (``problem``)."""
        if not isinstance(params, dict):
            return HandleRead([], UNKNOWN_HANDLE)
        remote_request_id = str(params.get("remote_request_id"))
        record, again = self._first_read(remote_request_id), False
        if record is None:
            record, again = self._peek(remote_request_id, "read"), True
        if record is None or record["handle"]["remote_engine_id"] != params.get("remote_engine_id"):
            return HandleRead([], UNKNOWN_HANDLE)
        if now > record["expires"]:
            return HandleRead([], EXPIRED_HANDLE, again)
        return HandleRead([int(token) for token in record["held"]], None, again)

    def _keep(self, key: str, record: JSONObject, kind: str = "issued") -> None:
        """(In one process, ``issued`` is the store of params.)"""
        (self.issued if kind == "issued" else self._stores[kind])[key] = record

    def _take(self, key: str, kind: str = "issued") -> JSONObject | None:
        """The record kept under this key, taken out (None: none is)."""
        return (self.issued if kind == "issued" else self._stores[kind]).pop(key, None)

    def _peek(self, key: str, kind: str) -> JSONObject | None:
        return self._stores[kind].get(key)

    def _first_read(self, key: str) -> JSONObject | None:
        """A handle moved from unread to read, in one step (None: it is not unread)."""
        record = self._take(key, "handle")
        if record is not None:
            self._keep(key, record, "read")
        return record


class SharedLedger(TransferLedger):
    """A ledger in ``directory``, which fakes in other processes share.

    ``issued`` and ``redeemed`` say what this process's fakes issued and
    redeemed; the directory holds what is issued and not yet redeemed by any.
    """

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: str, kind: str = "issued") -> str:
        # (a client's id is no file name: its digest is)
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        suffix = "" if kind == "issued" else f".{kind}"
        return os.path.join(self.directory, f"{digest}{suffix}.json")

    def _keep(self, key: str, record: JSONObject, kind: str = "issued") -> None:
        path = self._path(key, kind)
        written = f"{path}.{os.getpid()}-{uuid.uuid4().hex}.tmp"
        with open(written, "w", encoding="utf-8") as file:
            json.dump(record, file)
        os.replace(written, path)  # whole, or not there: a reader never sees half

    def _peek(self, key: str, kind: str) -> JSONObject | None:
        try:
            with open(self._path(key, kind), encoding="utf-8") as file:
                record: JSONObject = json.load(file)
        except FileNotFoundError:
            return None
        return record

    def _first_read(self, key: str) -> JSONObject | None:
        try:
            # atomic: of two prefills, one reads it first
            os.rename(self._path(key, "handle"), self._path(key, "read"))
        except FileNotFoundError:
            return None
        return self._peek(key, "read")

    def _take(self, key: str, kind: str = "issued") -> JSONObject | None:
        path = self._path(key, kind)
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
