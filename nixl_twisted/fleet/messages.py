"""The routing choices one replica tells the others, as the text of a Redis stream entry.

An entry is the choices of one reactor turn of one replica (``outbox``):
a first line ``v1 REPLICA`` (a letter first, so that txredisapi never takes
it for a number), then one line per choice:

- ``s ROLE URL CHAIN``: ``cache-aware`` sent a prompt to ``URL`` (its
  pool's memory of prefixes sent, ``backends.prefixes``): ``CHAIN`` is the
  prompt's chained piece hashes, eight bytes each, in base64. The hashes are
  blake2b's, the same in every process; a ``cache_salt`` is in them already.
- ``p ROLE URL SALT TOKENS``: ``kv-aware`` predicted the blocks of a
  prompt on ``URL`` (``kv.predictions``): its token ids, four bytes each
  (little-endian), and its ``cache_salt`` (UTF-8), both in base64 (an empty
  ``SALT``: none). Tokens, not block keys: a block's key is Python's own
  hash, seeded per process, so each replica keys the tokens itself.

Fields are separated by tabs. What a line does not parse as (a field too
many, a bound passed, bad base64) is skipped, never applied in part. Pure.
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nixl_twisted.backends.prefixes import MAX_PROMPT_BYTES, PIECE_BYTES

VERSION = "v1"
#: The most pieces a chain told holds (as many as the memory hashes of one prompt).
MAX_PIECES = MAX_PROMPT_BYTES // PIECE_BYTES
#: The most token ids a prediction told holds (32 KiB of them): a longer prompt's blocks
#: past them are predicted by the replica that chose only.
MAX_TOKENS = 8_192
ROLES = frozenset({"prefill", "decode"})


@dataclass(frozen=True)
class Sent:
    """``cache-aware`` of pool ``role`` sent the prompt of ``chain`` to ``url``."""

    role: str
    url: str
    chain: tuple[int, ...]


@dataclass(frozen=True)
class Predicted:
    """``kv-aware`` of pool ``role`` predicted the blocks of ``tokens`` (under ``salt``) on
    ``url``."""

    role: str
    url: str
    #: (as read: an ``array("I")``, which ``kv.blocks`` keys without a copy)
    tokens: Sequence[int]
    salt: str | None = None


Told = Sent | Predicted


def line(told: Told) -> str | None:
    """One choice as a line of an entry, or None when it cannot be told (a field with a tab
    or a newline in it)."""
    if not _plain(told.role) or not _plain(told.url):
        return None
    if isinstance(told, Sent):
        chain = told.chain[:MAX_PIECES]
        packed = struct.pack(f">{len(chain)}Q", *chain)
        return f"s\t{told.role}\t{told.url}\t{_b64(packed)}"
    salt = _b64(told.salt.encode("utf-8", "surrogatepass")) if told.salt is not None else ""
    return f"p\t{told.role}\t{told.url}\t{salt}\t{_b64(_packed(told.tokens[:MAX_TOKENS]))}"


def entry(replica: str, lines: Iterable[str]) -> str:
    """The text of one stream entry: who tells, then its lines."""
    return "\n".join([f"{VERSION} {replica}", *lines])


def read(text: str) -> tuple[str, list[Told]]:
    """Who told an entry and what it told ('' and nothing: not an entry of this version)."""
    head, _, body = text.partition("\n")
    version, _, replica = head.partition(" ")
    if version != VERSION or not replica:
        return "", []
    told: list[Told] = []
    for each in body.split("\n"):
        found = _parsed(each)
        if found is not None:
            told.append(found)
    return replica, told


def _parsed(text: str) -> Told | None:
    fields = text.split("\t")
    try:
        if fields[0] == "s" and len(fields) == 4 and fields[1] in ROLES:
            packed = base64.b64decode(fields[3], validate=True)
            if len(packed) % 8 or len(packed) > 8 * MAX_PIECES:
                return None
            return Sent(fields[1], fields[2], struct.unpack(f">{len(packed) // 8}Q", packed))
        if fields[0] == "p" and len(fields) == 5 and fields[1] in ROLES:
            salt = base64.b64decode(fields[3], validate=True).decode("utf-8", "surrogatepass")
            packed = base64.b64decode(fields[4], validate=True)
            if len(packed) % 4 or len(packed) > 4 * MAX_TOKENS:
                return None
            ids = array("I")
            ids.frombytes(packed)
            if sys.byteorder == "big":
                ids.byteswap()
            return Predicted(fields[1], fields[2], ids, salt or None)
    except (binascii.Error, ValueError, struct.error):
        return None
    return None


def _plain(field: str) -> bool:
    return bool(field) and "\t" not in field and "\n" not in field


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _packed(tokens: Sequence[int]) -> bytes:
    """Token ids as four bytes each, little-endian (ids past 32 bits as their low 32 bits,
    as ``kv.blocks`` keys them)."""
    try:
        ids = array("I", tokens)
    except (OverflowError, TypeError):
        ids = array("I", (int(t) & 0xFFFFFFFF for t in tokens))
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()
