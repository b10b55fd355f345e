"""Bidirectional KV transfer as vLLM 0.32-0.34 does it: decode's handle, read back by prefill.

With ``bidirectional`` on both fakes, a decode leg that ends pins its
blocks for ``decoder_blocks_ttl`` seconds and answers a handle on them
(``issue_handle`` in the ledger): the prompt's ids and the answer's, the
last token without KV. A prefill leg whose ``kv_transfer_params`` are
such a handle pulls the tokens it does not hold from decode, as vLLM
does, without checking what it pulls: a handle read again, or one whose
ids the prompt does not extend, is read all the same and spoils the
answer its decode gives; one that expired or that no decode issued is a
KV-load failure (``kv_load_failure_policy``: ``fail``, vLLM's 500, or
``recompute``). Only one side on: nothing happens, as in vLLM.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Request

from nixl_twisted.testing.ledger import TransferLedger
from nixl_twisted.testing.transfers import PromptSources

JSONObject = dict[str, Any]

#: What a decode leg's answer calls, with the ids it generated, once it ends.
HandleIssuer = Callable[[list[int]], JSONObject]


def is_handle(kv: object) -> bool:
    """``kv_transfer_params`` that are a decode's handle, not the proxy's lowering (whose
    ``remote_block_ids`` are null): vLLM's own test."""
    return (
        isinstance(kv, dict)
        and bool(kv.get("do_remote_decode"))
        and bool(kv.get("remote_block_ids"))
        and all(key in kv for key in _NAMES_DECODE)
    )


_NAMES_DECODE = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class Bidirectional:
    """Mixed into ``FakeVLLM``, whose fields these read."""

    name: str
    ledger: TransferLedger
    bidirectional: bool
    decoder_blocks_ttl: float
    kv_load_failure_policy: str
    kv_recompute_threshold: int
    handles_issued: list[JSONObject]
    handles_read: list[JSONObject]
    sources: PromptSources
    _kv_port: int

    def _time(self) -> IReactorTime:
        raise NotImplementedError

    def _handle_issuer(self, request: Request, role: str, prompt: list[int]) -> HandleIssuer | None:
        """What issues a decode leg's handle once its answer ends (None: it gets none)."""
        if not self.bidirectional or role != "decode":
            return None
        said = request.requestHeaders.getRawHeaders(b"x-request-id")
        request_id = said[0].decode("ascii") if said else uuid.uuid4().hex

        def issue(output: list[int]) -> JSONObject:
            expires = self._time().seconds() + self.decoder_blocks_ttl
            held = prompt + output
            handle = self.ledger.issue_handle(self.name, request_id, held, self._kv_port, expires)
            self.handles_issued.append(handle)
            return handle

        return issue

    def _reads_handle(self, role: str, kv: object) -> bool:
        return self.bidirectional and role == "prefill" and is_handle(kv)

    def _read_back(self, kv: JSONObject, prompt: list[int], cached: int) -> tuple[int, bool] | str:
        """A prefill leg's read of decode's handle: the tokens it pulls and whether the KV
        is wrong for its prompt; or why the load failed (the policy ``fail``)."""
        read = self.ledger.read_handle(kv, self._time().seconds())
        remote = kv.get("remote_num_tokens")
        problem = read.problem
        if problem is None and (type(remote) is not int or remote < 0):
            problem = "remote_num_tokens is not a count of tokens"
        if problem is not None:
            self.sources.failed_transfers += 1
            if self.kv_load_failure_policy == "fail":
                return problem
            return 0, False  # recomputed here: what is computed is right
        assert isinstance(remote, int)
        pulled = max(0, min(remote, len(prompt)) - cached)
        if pulled < self.kv_recompute_threshold:
            pulled = 0  # too few to be worth a transfer: computed here (the handle is spent)
        extends = prompt[:remote] == read.held[:remote]
        self.handles_read.append(
            {"handle": kv, "pulled": pulled, "again": read.again, "extends": extends}
        )
        # (nothing pulled, nothing wrong: what was computed here is the prompt's own)
        return pulled, pulled > 0 and (read.again or not extends)
