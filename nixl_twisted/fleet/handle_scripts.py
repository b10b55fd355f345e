"""The scripts and keys of decode's handles in ``--replicas-redis`` (multi-turn reuse).

Beside the keys of ``scripts`` (same prefix, same hash tag, one shard):
``handle:HEX``, a list of handles (``reuse.handles.Handle.to_json``, the
newest first, ``PER_KEY`` at most) under the digest of the ids they cover,
and ``turn:HEX``, a prompt's mark, each for decode's
``decoder_kv_blocks_ttl`` less the margin. ``KEEP`` writes both; ``FIND`` reads the
first of a prompt's digests that holds one, without taking it (else says
whether one marks a turn); ``CLAIM`` takes it only if it is still the
one found, so that of two replicas one reads it and the other is told no.
What a key holds is checked by the reader (``reuse.handles.from_json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred

from nixl_twisted.fleet.lua_common import Caller
from nixl_twisted.fleet.replies import WrongReply, count_of
from nixl_twisted.reuse.kept import PER_KEY

# ARGV: prefix, replica, key, handle, ms, the turn's key and mark ("" for none). The handle
# goes first in its key's list, PER_KEY kept (a key that is no list, as a writer left it, is
# made one again). Returns 0.
KEEP = f"""
local key = ARGV[1] .. 'handle:' .. ARGV[3]
local pushed = redis.pcall('LPUSH', key, ARGV[4])
if type(pushed) == 'table' and pushed.err then
  redis.call('DEL', key)
  redis.call('LPUSH', key, ARGV[4])
end
redis.call('LTRIM', key, 0, {PER_KEY - 1})
redis.call('PEXPIRE', key, tonumber(ARGV[5]))
if ARGV[6] ~= '' then
  redis.call('SET', ARGV[1] .. 'turn:' .. ARGV[6], ARGV[7], 'PX', tonumber(ARGV[5]))
end
return 0
"""

# ARGV: prefix, replica, then keys, longest prefix first. The handles under the first that
# holds any, as {its place from 1, each}; else {0, the mark} of the first that marks a turn;
# else nil.
FIND = f"""
for i = 3, #ARGV do
  local got = redis.pcall('LRANGE', ARGV[1] .. 'handle:' .. ARGV[i], 0, {PER_KEY - 1})
  if type(got) == 'table' and not got.err and #got > 0 then
    table.insert(got, 1, i - 2)
    return got
  end
end
for i = 3, #ARGV do
  local mark = redis.pcall('GET', ARGV[1] .. 'turn:' .. ARGV[i])
  if type(mark) == 'string' then return {{0, mark}} end
end
return nil
"""

# ARGV: prefix, replica, key, the stamp of the handle found (letters and digits). 1: taken;
# 0: read or gone since.
CLAIM = f"""
local key = ARGV[1] .. 'handle:' .. ARGV[3]
local kept = redis.pcall('LRANGE', key, 0, {PER_KEY - 1})
if type(kept) ~= 'table' or kept.err then return 0 end
for _, held in ipairs(kept) do
  if string.find(held, '"stamp":"' .. ARGV[4] .. '"', 1, true) then
    redis.call('LREM', key, 1, held)
    return 1
  end
end
return 0
"""


def keep(
    caller: Caller, key: bytes, handle: str, ms: int, turn: tuple[bytes, str] | None
) -> Deferred[Any]:
    """Run ``KEEP``: ``handle`` (as JSON) under ``key`` for ``ms``, and its turn's mark
    (``Handle.turn_mark``: its key and what it says)."""
    marked, said = (turn[0].hex(), turn[1]) if turn is not None else ("", "")
    return caller.call(KEEP, [key.hex(), handle, ms, marked, said], "handle_keep", _as_is)


def find(caller: Caller, keys: Sequence[bytes]) -> Deferred[tuple[int, list[bytes]] | None]:
    """Run ``FIND``: the place in ``keys`` (from 1) of the first that holds handles, and what
    it holds; place 0: none does, and what the first that marks a turn says; None: neither."""
    return caller.call(FIND, [key.hex() for key in keys], "handle_find", _found)


def claim(caller: Caller, key: bytes, stamp: str) -> Deferred[bool]:
    """Run ``CLAIM``: whether the handle ``stamp`` names was still under ``key``, and is now
    taken."""
    return caller.call(CLAIM, [key.hex(), stamp], "handle_claim", lambda r: count_of(r) == 1)


def _found(reply: Any) -> tuple[int, list[bytes]] | None:
    if reply is None:
        return None
    if not isinstance(reply, list) or len(reply) < 2:
        raise WrongReply(f"FIND answered {reply!r}")
    held = [each if isinstance(each, bytes) else str(each).encode() for each in reply[1:]]
    return count_of(reply[0]), held


def _as_is(reply: Any) -> Any:
    return reply
