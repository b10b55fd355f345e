"""The handoff checked: are prefill's ``kv_transfer_params`` something decode can pull from?

vLLM's NixlConnector on decode pulls the prompt's KV only when the params
say ``do_remote_prefill`` and carry ``remote_block_ids`` (non-empty) with
``remote_engine_id``, ``remote_host`` and ``remote_port`` (vLLM 0.32 to 0.34's
``pull_scheduler``: ``get_num_new_matched_tokens``, ``update_state_after_alloc``).
Without them it logs "Got invalid KVTransferParams" once and computes the
whole prompt itself: no error, twice the work. The proxy checks them before
decode is sent, so that such an answer is a prefill failure instead
(``docs/protocol.md``, "The handoff checked"). Keys a later vLLM adds pass
through unchecked; the params are never rebuilt.
"""

from __future__ import annotations

from typing import Any

from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.lowering import JSONObject, read_json

#: The keys decode reads to find prefill's blocks, whatever vLLM's version.
REQUIRED = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")

#: Why a handoff is refused, in a word: the ``problem`` label of
#: ``nixlproxy_prefill_bad_handoffs_total``.
PROBLEMS = ("not_remote_prefill", "missing_key", "bad_value", "no_blocks", "disallowed_host")


class BadHandoff(ValueError):
    """Prefill's params would make decode compute the prompt itself; ``problem``: which way."""

    def __init__(self, problem: str, said: str) -> None:
        super().__init__(said)
        self.problem = problem


_LIST = {list}
_INT = {int}


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_ids(value: object) -> list[object] | None:
    """Every block id, flat (vLLM sends one list per KV-cache group); None: not lists of ids."""
    if not isinstance(value, list):
        return None
    groups = value if value and set(map(type, value)) == _LIST else [value]
    flat = [block for group in groups for block in group]
    # (by type, not isinstance: a bool is no block id; one set, not a call per block)
    return flat if set(map(type, flat)) <= _INT else None


def check_handoff(params: JSONObject) -> None:
    """Raise ``BadHandoff`` unless decode can pull the prompt's KV with ``params``.

    Empty ``remote_block_ids`` pass only when ``remote_num_tokens`` says 0
    tokens were computed: vLLM allocates a block for any prompt, even one
    token, so a prompt with tokens and no blocks was not prefilled.
    """
    if params.get("do_remote_prefill") is not True:
        raise BadHandoff("not_remote_prefill", "do_remote_prefill is not true")
    for key in REQUIRED:
        if params.get(key) is None:
            raise BadHandoff("missing_key", f"{key} is missing")
    host, port, engine = params["remote_host"], params["remote_port"], params["remote_engine_id"]
    if not isinstance(host, str) or not host:
        raise BadHandoff("bad_value", f"remote_host is {host!r}, not a host name")
    if not _whole(port) or not 0 < port < 65536:
        raise BadHandoff("bad_value", f"remote_port is {port!r}, not a port")
    if not isinstance(engine, str) or not engine:
        raise BadHandoff("bad_value", f"remote_engine_id is {engine!r}, not an id")
    request_id = params.get("remote_request_id")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise BadHandoff("bad_value", f"remote_request_id is {request_id!r}, not an id")
    tp_size = params.get("tp_size")
    if tp_size is not None and (not _whole(tp_size) or tp_size < 1):
        raise BadHandoff("bad_value", f"tp_size is {tp_size!r}, not a size")
    blocks = _block_ids(params["remote_block_ids"])
    if blocks is None:
        raise BadHandoff("bad_value", "remote_block_ids is not a list of block ids")
    if not blocks and params.get("remote_num_tokens") != 0:
        raise BadHandoff("no_blocks", "remote_block_ids is empty for a prompt that has tokens")


def read_prefill_answer(raw: bytes, instance: str) -> Any:
    """Prefill's answer, parsed once: its params and its token ids are read from it."""
    try:
        return read_json(raw)
    except (ValueError, UnicodeDecodeError):
        raise ProxyError(
            ErrorCode.PREFILL_INVALID_RESPONSE,
            f"prefill instance {instance} answered with a body that is not JSON",
        ) from None


def kv_transfer_params_of(answer: Any, instance: str) -> JSONObject:
    """Take ``kv_transfer_params`` from a parsed prefill answer, or explain with a 502.

    The value is returned as parsed, never rebuilt: decode needs every key
    current vLLM puts there, including keys that do not exist yet.
    """
    if not isinstance(answer, dict) or "kv_transfer_params" not in answer:
        raise ProxyError(
            ErrorCode.MISSING_KV_TRANSFER_PARAMS,
            f"prefill response did not include kv_transfer_params (prefill instance {instance})",
        )
    params = answer["kv_transfer_params"]
    if not isinstance(params, dict):
        raise ProxyError(
            ErrorCode.INVALID_KV_TRANSFER_PARAMS,
            "prefill response kv_transfer_params is not a JSON object "
            f"(prefill instance {instance})",
        )
    return params


def extract_kv_transfer_params(raw: bytes, instance: str) -> JSONObject:
    """Take ``kv_transfer_params`` from a prefill answer's bytes, or explain with a 502."""
    return kv_transfer_params_of(read_prefill_answer(raw, instance), instance)
