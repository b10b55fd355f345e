"""The scripts and keys of the fleet's routing view in ``--replicas-redis``.

Beside the keys of ``scripts`` (same prefix, same hash tag, one shard):

- ``routes:sent``, a stream: each ``cache-aware`` choice of every replica
  (``messages``: a prompt's piece hashes and the instance it went to), the
  latest ``SENT_ENTRIES`` kept (``XADD MAXLEN ~``): what a replica that
  starts reads to remember what the fleet sent;
- ``routes:predicted``, a stream: each ``kv-aware`` prediction (a prompt's
  token ids and its instance), the latest ``PREDICTED_ENTRIES`` and only
  those of the last ``PREDICTED_LIFE_MS`` (``XTRIM MINID``, exact: the
  stream is short): a prediction counts for that long;
- ``response:ID``: the decode instance that holds the stored response
  ``ID`` (Responses API) and its owner (``URL\\nTENANT``, the tenant empty
  for none), for ``RESPONSE_TTL_MS``;
- ``responses:SHA1``, a sorted set per owner (SHA-1 of the tenant's name):
  its ids by when they were stored, the latest CAP kept (an older one's
  ``response:ID`` deleted with it), for ``RESPONSE_TTL_MS`` after the last.

``SHARE`` is the one write: what a replica chose in one reactor turn, in one
call. Readers take the streams with ``XREAD`` (``route_reader``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred

from nixl_twisted.fleet.lua_common import Caller
from nixl_twisted.kv.predictions import PREDICTED_LIFE

#: The choices of ``cache-aware`` kept in Redis (one entry each, at most about 2.7 KB:
#: a 64 KiB prompt's 256 piece hashes in base64; about 450 bytes for an 8 KB prompt).
SENT_ENTRIES = 4096
#: The predictions of ``kv-aware`` kept (at most 8,192 token ids each, 44 KB in base64).
PREDICTED_ENTRIES = 256
#: How long a prediction counts (``kv.predictions.PREDICTED_LIFE``), in ms.
PREDICTED_LIFE_MS = int(PREDICTED_LIFE * 1000)
#: How long the instance of a stored response is kept, in ms (an hour).
RESPONSE_TTL_MS = 3_600_000

SENT, PREDICTED = "routes:sent", "routes:predicted"

# ARGV: prefix, replica, S, N, CAP, then S entries for routes:sent, N for routes:predicted,
# then triples of (response id, decode instance URL, owner: the tenant, "" for none), each
# owner's latest CAP kept. Returns 0.
SHARE = f"""
local P = ARGV[1]
local s, n, cap = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
for i = 6, 5 + s do
  redis.call('XADD', P .. '{SENT}', 'MAXLEN', '~', {SENT_ENTRIES}, '*', 'm', ARGV[i])
end
for i = 6 + s, 5 + s + n do
  redis.call('XADD', P .. '{PREDICTED}', 'MAXLEN', '~', {PREDICTED_ENTRIES}, '*', 'm', ARGV[i])
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if n > 0 then
  redis.call('XTRIM', P .. '{PREDICTED}', 'MINID', now - {PREDICTED_LIFE_MS})
end
for i = 6 + s + n, #ARGV - 2, 3 do
  local id, owner = ARGV[i], ARGV[i + 2]
  redis.call('SET', P .. 'response:' .. id, ARGV[i + 1] .. '\\n' .. owner, 'PX', {RESPONSE_TTL_MS})
  local index = P .. 'responses:' .. redis.sha1hex(owner)
  redis.call('ZADD', index, now, id)
  redis.call('ZREMRANGEBYSCORE', index, '-inf', now - {RESPONSE_TTL_MS})
  local over = redis.call('ZCARD', index) - cap
  if over > 0 then
    for _, gone in ipairs(redis.call('ZRANGE', index, 0, over - 1)) do
      redis.call('DEL', P .. 'response:' .. gone)
    end
    redis.call('ZREMRANGEBYRANK', index, 0, over - 1)
  end
  redis.call('PEXPIRE', index, {RESPONSE_TTL_MS})
end
return 0
"""


@dataclass(frozen=True)
class StoredResponse:
    """A stored response's id, the decode instance that holds it, and its owner ("": none)."""

    id: str
    instance: str
    owner: str = ""


def share_args(
    sent: Sequence[str],
    predicted: Sequence[str],
    stored: Sequence[StoredResponse] = (),
    per_owner: int = 1000,
) -> list[object]:
    """``SHARE``'s arguments after the prefix and the replica (``Replicas.call`` puts those):
    the entries for each stream, the responses stored, each owner's latest ``per_owner``
    kept. The one place that knows the script's argument order."""
    responses = [part for each in stored for part in (each.id, each.instance, each.owner)]
    return [len(sent), len(predicted), per_owner, *sent, *predicted, *responses]


# ARGV: prefix, replica, response id. Its decode instance and owner (URL\\nTENANT), or nil.
RESPONSE = """
return redis.call('GET', ARGV[1] .. 'response:' .. ARGV[3])
"""


def share(
    caller: Caller,
    sent: Sequence[str],
    predicted: Sequence[str],
    stored: Sequence[StoredResponse] = (),
    per_owner: int = 1000,
) -> Deferred[Any]:
    """Run ``SHARE``: what this replica chose and predicted, and the responses it stored."""
    return caller.call(SHARE, share_args(sent, predicted, stored, per_owner), "share", _as_is)


def response(caller: Caller, response_id: str) -> Deferred[Any]:
    """Run ``RESPONSE``: a stored response's decode instance and owner (``URL\\nTENANT``),
    or None."""
    return caller.call(RESPONSE, [response_id], "response", _as_is)


def _as_is(reply: Any) -> Any:
    return reply
