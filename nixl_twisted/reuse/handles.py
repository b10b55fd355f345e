"""Decode's handle on a finished conversation's KV, and whether a next prompt may read it.

With vLLM's bidirectional KV transfer, decode pins a finished two-leg
request's blocks and answers its own ``kv_transfer_params``: a handle the
next turn's prefill leg can pull those blocks with. vLLM checks nothing
about it (``docs/protocol.md``, "Multi-turn reuse"): a prompt that does not
extend the ids decode holds reads wrong KV and answers 200. So a handle is
kept with the ids it covers (the prompt and the answer, ``return_token_ids``)
and offered only to a prompt whose own ids extend them (``Handle.extends``).

A handle is found by its sequence, not by a guess at the conversation: it is
kept under the digest of its first ``BLOCK``-aligned ids within its scope
(tenant, ``cache_salt``, model), and a new prompt looks under the digest of
each of its own ``BLOCK``-aligned prefixes, longest first (``prefix_keys``).
Conversations that share a long system prompt never take each other's.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: A prompt's last ids a turn's mark leaves out (a generation prompt's last token, such as
#: a space, may be rendered merged with the answer's first in the next turn).
MARK_SLACK = 4
#: Ids per key step; vLLM recomputes fewer remote tokens than 64 anyway
#: (``kv_recompute_threshold``), so a handle covering fewer is not kept.
BLOCK = 64


@dataclass(frozen=True)
class Handle:
    """What decode answered for a finished request, and what it covers."""

    #: Decode's ``kv_transfer_params``, verbatim (the prefill leg carries them as they are).
    params: dict[str, Any]
    #: The decode instance that holds the blocks (its URL): the next decode leg goes there.
    instance: str
    #: The ids decode holds: the prompt's, then the answer's (8 bytes each: ``ids_of``).
    tokens: array[int]
    #: When it stops being offered, on the proxy's clock (its lifetime less a margin).
    until: float
    #: Which one it is, whatever else is kept under its key (a claim names it).
    stamp: str = ""
    #: How many of ``tokens`` were its prompt's (0: not known).
    asked: int = 0

    @property
    def covered(self) -> int:
        """The tokens whose KV decode holds (``remote_num_tokens``: the last token's KV is
        never computed), at most the ids it was kept with."""
        said = self.params.get("remote_num_tokens")
        most = len(self.tokens) - 1
        if type(said) is int and 0 < said <= most:
            return said
        return most

    def extends(self, prompt: Sequence[int]) -> bool:
        """``prompt`` begins with every id decode holds KV for, and goes on past them (vLLM
        computes at least the last token itself)."""
        covered = self.covered
        if len(prompt) <= covered:
            return False
        try:
            return ids_of(prompt[:covered]) == self.tokens[:covered]
        except OverflowError:  # (an id no vocabulary has)
            return False

    def key(self, scope: bytes) -> bytes | None:
        """The digest it is kept under (None: it covers too few tokens to be worth one)."""
        aligned = self.covered // BLOCK * BLOCK
        if aligned < BLOCK:
            return None
        return _digests(scope, self.tokens[:aligned])[-1]

    def turn_mark(self, scope: bytes) -> tuple[bytes, str] | None:
        """Its prompt's mark: the digest it is kept under (its prompt's ids, ``BLOCK``-aligned)
        and what it says (how many ids it marks, and their digest: the prompt's but its last
        ``MARK_SLACK``, which a template may render merged with the answer). A next prompt
        that begins with those but does not extend the handle went on from its turn but not
        from what decode holds (a ``mismatch``). None: too short to mark, or marked by the
        handle's own key."""
        marked = self.asked - MARK_SLACK
        aligned = marked // BLOCK * BLOCK
        if aligned < BLOCK or aligned >= self.covered // BLOCK * BLOCK:
            return None
        said = f"{marked}:{exact_digest(scope, self.tokens[:marked]).hex()}"
        return _digests(scope, self.tokens[:aligned])[-1], said

    def to_json(self) -> str:
        """As the replicas keep it in Redis."""
        return json.dumps(
            {
                "params": self.params,
                "instance": self.instance,
                "tokens": self.tokens.tolist(),
                "until": self.until,
                "stamp": self.stamp,
            },
            separators=(",", ":"),
        )


#: Ids one handle covers at most (a conversation past a million tokens is not kept).
MAX_IDS = 1 << 20
#: Every token id is below it (eight bytes each).
ID_BOUND = 1 << 63


def ids_of(ids: Sequence[int]) -> array[int]:
    """``ids`` eight bytes each (``OverflowError``: one no vocabulary has)."""
    return array("q", ids)


#: What a prefill instance reads decode's blocks with (vLLM's NIXL connector).
REQUIRED = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")


def readable(params: dict[str, Any]) -> bool:
    """``params`` are a handle prefill can read decode's blocks with: decode's own answer
    (``do_remote_decode``), naming an engine, a host, a port and blocks."""
    if params.get("do_remote_decode") is not True or params.get("do_remote_prefill") is True:
        return False
    if any(params.get(key) is None for key in REQUIRED):
        return False
    host, port = params["remote_host"], params["remote_port"]
    return (
        isinstance(host, str)
        and bool(host)
        and type(port) is int
        and 0 < port < 65536
        and isinstance(params["remote_engine_id"], str)
        and isinstance(params["remote_block_ids"], list)
    )


def from_json(raw: object) -> Handle | None:
    """A handle as Redis gave it back, checked: anyone who can write there may have written
    anything (None: not a handle)."""
    try:
        value = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict):
        return None
    params, instance = value.get("params"), value.get("instance")
    tokens, until, stamp = value.get("tokens"), value.get("until"), value.get("stamp")
    if not isinstance(params, dict) or not isinstance(instance, str):
        return None
    if not isinstance(stamp, str) or not stamp.isalnum():
        return None
    if not isinstance(tokens, list) or len(tokens) > MAX_IDS:
        return None
    if not all(type(t) is int and 0 <= t < ID_BOUND for t in tokens):
        return None
    if not isinstance(until, int | float) or isinstance(until, bool) or not readable(params):
        return None
    return Handle(params, instance, ids_of(tokens), float(until), stamp)


def scope_of(tenant: str | None, salt: str | None, model: str | None) -> bytes:
    """Whose handles a request may read: its tenant's, in its ``cache_salt``, for its model."""
    parts = (tenant or "", salt or "", model or "")
    return "\0".join(parts).encode("utf-8", "surrogatepass")


def prefix_keys(scope: bytes, prompt: Sequence[int]) -> list[bytes]:
    """The digests a handle that ``prompt`` extends may be kept under, longest first."""
    usable = (len(prompt) - 1) // BLOCK * BLOCK  # (a handle must leave it a token)
    if usable < BLOCK:
        return []
    return _digests(scope, prompt[:usable])[::-1]


def marks(said: str, scope: bytes, prompt: Sequence[int]) -> bool:
    """A turn's mark (``Handle.turn_mark``) says ``prompt`` went on from that turn's prompt:
    it begins with all of it, and has more."""
    count, _, digest = said.partition(":")
    if not count.isdigit() or len(prompt) <= int(count):
        return False
    return exact_digest(scope, prompt[: int(count)]).hex() == digest


def exact_digest(scope: bytes, ids: Sequence[int]) -> bytes:
    """The digest of ``scope`` and every id of ``ids``."""
    return hashlib.blake2b(
        hashlib.blake2b(scope).digest() + array("q", ids).tobytes(), digest_size=16
    ).digest()


def _digests(scope: bytes, ids: Sequence[int]) -> list[bytes]:
    """The digest of ``scope`` and ``ids``'s first ``BLOCK``, ``2 * BLOCK``, ... ids."""
    raw = array("q", ids).tobytes()
    step = BLOCK * 8
    # (the scope as a fixed-length digest first: no scope's bytes read as another's ids)
    running = hashlib.blake2b(hashlib.blake2b(scope).digest(), digest_size=16)
    found = []
    for start in range(0, len(raw) - step + 1, step):
        running.update(raw[start : start + step])
        found.append(running.copy().digest())
    return found
