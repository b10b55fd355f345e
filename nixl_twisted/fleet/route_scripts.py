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
  ``ID`` (Responses API), for ``RESPONSE_TTL_MS``.

``SHARE`` is the one write: what a replica chose in one reactor turn, in one
call. Readers take the streams with ``XREAD`` (``route_reader``).
"""

from __future__ import annotations

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

# ARGV: prefix, replica, S, N, then S entries for routes:sent, N for routes:predicted, then
# pairs of (response id, decode instance URL). Returns 0.
SHARE = f"""
local P = ARGV[1]
local s, n = tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 5, 4 + s do
  redis.call('XADD', P .. '{SENT}', 'MAXLEN', '~', {SENT_ENTRIES}, '*', 'm', ARGV[i])
end
for i = 5 + s, 4 + s + n do
  redis.call('XADD', P .. '{PREDICTED}', 'MAXLEN', '~', {PREDICTED_ENTRIES}, '*', 'm', ARGV[i])
end
if n > 0 then
  local t = redis.call('TIME')
  local oldest = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - {PREDICTED_LIFE_MS}
  redis.call('XTRIM', P .. '{PREDICTED}', 'MINID', oldest)
end
for i = 5 + s + n, #ARGV - 1, 2 do
  redis.call('SET', P .. 'response:' .. ARGV[i], ARGV[i + 1], 'PX', {RESPONSE_TTL_MS})
end
return 0
"""

# ARGV: prefix, replica, response id. The decode instance that holds it, or nil.
RESPONSE = """
return redis.call('GET', ARGV[1] .. 'response:' .. ARGV[3])
"""
