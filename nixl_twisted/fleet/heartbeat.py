"""The heartbeat script (``HEARTBEAT``), which keeps ``--replicas-redis`` alive and whole, and
its reply read (``Beat``).

Each replica runs it once a second. Besides its own liveness, it forgets
every replica whose heartbeat expired, with what it held, and it heals what
anyone who can write to Redis may have broken, so that nothing forged
outlives a few heartbeats (``security.md``, "Redis is inside the trust
boundary"):

- a key of the wrong type is deleted, a liveness score later than now plus
  the TTL is brought back to it (a forged replica lapses within the TTL);
- the counts (``slots``, ``tenants``, ``waiting``) are rebuilt from the
  live replicas' own records (``r:ID:leases``, ``r:ID:tenants``,
  ``r:ID:waits``), entries that do not parse skipped and dropped;
- a queue entry that no live replica holds is dropped, and so is a
  tenant's last tag (``last:MODEL``) that the model's clock has passed
  (it no longer changes any tag), past ``LAST_MAX`` fields all of them;
- a replica's ``info`` is read only when it is at most ``INFO_MAX`` bytes.

It answers this replica's own records (``Own``), so that the replica gives
back what Redis says it holds and it does not (``Replicas.on_records``): a
record of a live replica is trusted by every script, and only its replica
knows whether it is true.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred

from nixl_twisted.fleet.lua_common import COMMON, Evaluates
from nixl_twisted.fleet.replies import WrongReply, count_of, text, view_of

#: The most bytes of a replica's ``info`` read (its own is far less).
INFO_MAX = 4096
#: The most tenants' last tags one model keeps: past it, all are forgotten (their tenants'
#: next requests are tagged from the model's clock, as a new tenant's).
LAST_MAX = 10_000

# ARGV: prefix, replica, ttl (ms), what it says of itself (JSON), the longest ttl any
# replica's heartbeat has (ms): no liveness lasts longer.
# Returns {1 if this replica was alive still (else what it held is gone: restore it),
# leases forgotten, {replica, info, ...} of the live ones, the slots' view (HGETALL), its
# version, the replicas forgotten, the requests waiting, this replica's own records: its
# waits, leases and tenants' places}.
HEARTBEAT = (
    COMMON
    + f"""
local INFO_MAX, LAST_MAX = {INFO_MAX}, {LAST_MAX}
"""
    + """
local now = now_ms()
local ttl = whole(ARGV[3]) or 0
local latest = now + math.max(ttl, whole(ARGV[5]) or 0)
for _, k in ipairs({{'alive', 'zset'}, {'info', 'hash'}, {'slots', 'hash'},
                    {'tenants', 'hash'}, {'v', 'hash'}, {'grants', 'list'}, {'caps', 'hash'},
                    {'waiting', 'string'}, {'version', 'string'}, {'seq', 'string'}}) do
  local t = redis.call('TYPE', P .. k[1])['ok']
  if t ~= 'none' and t ~= k[2] then redis.call('DEL', P .. k[1]) end
end
if not whole(redis.call('GET', P .. 'version')) then redis.call('DEL', P .. 'version') end
if not whole(redis.call('GET', P .. 'seq')) then redis.call('DEL', P .. 'seq') end
redis.call('LTRIM', P .. 'grants', 0, 63)
local grants, times = redis.call('LRANGE', P .. 'grants', 0, -1), {}
for _, g in ipairs(grants) do
  if num(g) then times[#times + 1] = g end
end
if #times < #grants then
  redis.call('DEL', P .. 'grants')
  if #times > 0 then redis.call('RPUSH', P .. 'grants', unpack(times)) end
end
for _, r in ipairs(redis.call('ZRANGEBYSCORE', P .. 'alive', '(' .. latest, '+inf')) do
  redis.call('ZADD', P .. 'alive', latest, r)
end
local known = redis.call('ZSCORE', P .. 'alive', me)
local mine = known ~= false and tonumber(known) > now
local purged, dead = 0, {}
for _, r in ipairs(redis.call('ZRANGEBYSCORE', P .. 'alive', '-inf', now)) do
  if r ~= me then
    purged = purged + forget(r, false)
    dead[#dead + 1] = r
  end
end
if not mine then forget(me, true) end
redis.call('ZADD', P .. 'alive', now + ttl, me)
redis.call('HSET', P .. 'info', me, ARGV[4])

local live, seen = {}, {}
local slots, tenants, waiting, models = {}, {}, 0, {}
for _, r in ipairs(redis.call('ZRANGEBYSCORE', P .. 'alive', now, '+inf')) do
  seen[r] = true
  live[#live + 1] = r
  if redis.call('HSTRLEN', P .. 'info', r) <= INFO_MAX then
    live[#live + 1] = redis.call('HGET', P .. 'info', r) or '{}'
  else
    live[#live + 1] = '{}'
  end
  local key = P .. 'r:' .. r .. ':leases'
  for _, e in ipairs(members(key)) do
    local field = lease_field(e)
    if field then slots[field] = (slots[field] or 0) + 1 else redis.call('SREM', key, e) end
  end
  key = P .. 'r:' .. r .. ':tenants'
  for _, e in ipairs(members(key)) do
    local t = tenant_of(e)
    if t then tenants[t] = (tenants[t] or 0) + 1 else redis.call('SREM', key, e) end
  end
  key = P .. 'r:' .. r .. ':waits'
  for _, e in ipairs(members(key)) do
    local model, prio, member = wait_of(e)
    if model and safe('ZSCORE', P .. 'q:' .. model .. ':' .. prio, member) then
      waiting = waiting + 1
      models[model] = true
    else
      redis.call('SREM', key, e)
    end
  end
end

local function settle(key, counts, changed)
  local flat = redis.call('HGETALL', key)
  for i = 1, #flat, 2 do
    local field, want = flat[i], counts[flat[i]]
    if want == nil then
      redis.call('HDEL', key, field)
      if changed then changed[#changed + 1] = field .. '\\t0' end
    elseif whole(flat[i + 1]) ~= want then
      redis.call('HSET', key, field, want)
      if changed then changed[#changed + 1] = field .. '\\t' .. want end
    end
    counts[field] = nil
  end
  for field, want in pairs(counts) do
    redis.call('HSET', key, field, want)
    if changed then changed[#changed + 1] = field .. '\\t' .. want end
  end
end
local changed = {}
settle(P .. 'slots', slots, changed)
settle(P .. 'tenants', tenants, nil)
if whole(redis.call('GET', P .. 'waiting')) ~= waiting then
  redis.call('SET', P .. 'waiting', waiting)
end
if #changed > 0 then
  bump(P .. 'version', 1)
  publish(changed)
end

local flat = redis.call('HGETALL', P .. 'v')
for i = 1, #flat, 2 do
  if num(flat[i + 1]) == nil then
    redis.call('HDEL', P .. 'v', flat[i])
  else
    models[flat[i]] = true
  end
end
for model in pairs(models) do
  local prios = safe('ZRANGE', P .. 'qp:' .. model, 0, -1)
  if prios == nil then
    redis.call('DEL', P .. 'qp:' .. model)
    prios = {}
  end
  for _, prio in ipairs(prios) do
    local q = P .. 'q:' .. model .. ':' .. prio
    local queued = safe('ZRANGE', q, 0, -1)
    if queued == nil then
      redis.call('DEL', q)
      queued = {}
    end
    for _, member in ipairs(queued) do
      local r = string.match(member, '^[^:]*:([^:]*):')
      if not (r and seen[r] and redis.call('SISMEMBER', P .. 'r:' .. r .. ':waits',
                                         model .. '\\n' .. prio .. '\\n' .. member) == 1) then
        redis.call('ZREM', q, member)
      end
    end
    if redis.call('ZCARD', q) == 0 then redis.call('ZREM', P .. 'qp:' .. model, prio) end
  end
  local clock = num(redis.call('HGET', P .. 'v', model)) or 0
  local lkey = P .. 'last:' .. model
  local tags = safe('HGETALL', lkey)
  if tags == nil then
    redis.call('DEL', lkey)
  else
    for i = 1, #tags, 2 do
      local tag = num(tags[i + 1])
      if tag == nil or tag <= clock then redis.call('HDEL', lkey, tags[i]) end
    end
    if redis.call('HLEN', lkey) > LAST_MAX then redis.call('DEL', lkey) end
  end
end
local mykey = P .. 'r:' .. me .. ':'
return {mine and 1 or 0, purged, live, redis.call('HGETALL', P .. 'slots'), version(), dead,
        waiting, {members(mykey .. 'waits'), members(mykey .. 'leases'),
                  members(mykey .. 'tenants')}}
"""
)


@dataclass(frozen=True)
class Own:
    """What Redis records this replica holds, as a heartbeat left it: its requests waiting
    (``MODEL\\nPRIORITY\\nMEMBER``), its leases (``POOL|URL|LEASE``) and its tenants' places
    (``TENANT|ID``)."""

    waits: list[str]
    leases: list[str]
    tenants: list[str]


@dataclass(frozen=True)
class Beat:
    """What a heartbeat answered."""

    #: This replica was alive still (else what it held was forgotten: written back whole).
    mine: bool
    #: Leases given back for the replicas forgotten now, and those replicas.
    purged: int
    dead: list[str]
    #: The live replicas, by id: what each says of itself.
    live: dict[str, dict[str, Any]]
    #: The slots' view (``POOL|URL`` -> legs) and its version.
    view: dict[str, int]
    version: int
    #: Requests waiting in the fleet's queue, as this beat rebuilt the count.
    waiting: int
    #: This replica's own records.
    own: Own


def heartbeat(
    link: Evaluates, prefix: str, replica: str, ttl_ms: int, info: str, longest_ttl_ms: int
) -> Deferred[Beat]:
    """Run ``HEARTBEAT``: ``replica`` alive for ``ttl_ms`` more, the dead forgotten and what
    was forged healed; its reply read."""
    sent = link.eval(HEARTBEAT, [], [prefix, replica, ttl_ms, info, longest_ttl_ms])
    return sent.addCallback(read_beat)


def read_beat(reply: object) -> Beat:
    """``HEARTBEAT``'s reply, each part checked (``WrongReply`` when one is not as written)."""
    # (Its own records may be left off, as by a stand-in for Redis: then none is given back.)
    if not isinstance(reply, Sequence) or len(reply) not in (7, 8):
        raise WrongReply(reply)
    mine, purged, live, view, version, dead, waiting, own = (*reply, ([], [], []))[:8]
    if not isinstance(live, Sequence) or not isinstance(dead, Sequence) or len(live) % 2:
        raise WrongReply(reply)
    if not isinstance(own, Sequence) or len(own) != 3:
        raise WrongReply(reply)
    if not all(isinstance(records, Sequence) for records in own):
        raise WrongReply(reply)
    return Beat(
        mine=count_of(mine) == 1,
        purged=count_of(purged),
        dead=[text(replica) for replica in dead],
        live={text(live[i]): _info(live[i + 1]) for i in range(0, len(live), 2)},
        view=view_of(view),
        version=count_of(version),
        waiting=count_of(waiting),
        own=Own(*([text(record) for record in records] for records in own)),
    )


def _info(value: object) -> dict[str, Any]:
    """What a replica says of itself (nothing, when it says more than ``INFO_MAX`` bytes or
    not a JSON object)."""
    said = text(value)
    if len(said) > INFO_MAX:
        return {}
    try:
        parsed = json.loads(said)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
