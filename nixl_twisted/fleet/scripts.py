"""The Lua scripts every replica runs in ``--replicas-redis``: the only writers of its keys.

Each script is atomic (Redis runs one at a time), reads Redis's own clock
(``TIME``: one clock for every replica) and keeps every key of a proxy under
one prefix with one hash tag (``nixlproxy:{fleet}:``), so that they live in
one shard. ``ARGV[1]`` is that prefix, ``ARGV[2]`` the replica's id. The keys:

- ``alive``: each replica's heartbeat, as the time (ms) it expires;
- ``slots``: each instance's legs in flight over every replica, by
  ``POOL|URL``; ``r:ID:leases`` the leases each replica holds
  (``POOL|URL|LEASE``), given back one by one, or all at once when it dies;
- ``q:MODEL:PRIORITY``: the requests waiting for a slot, scored by their
  weighted-fair finish tag, ``qp:MODEL`` the priorities with some waiting,
  ``v`` each model's virtual time, ``last:MODEL`` each tenant's last tag,
  ``r:ID:waits`` what each replica's clients wait for, ``waiting`` how many
  wait in all and ``grants`` when the latest were let go (the drain rate);
- ``tenants``: each tenant's requests in flight over every replica,
  ``r:ID:tenants`` each replica's (``TENANT|ID``);
- ``caps``: each instance's cap over the fleet, the lowest of the live
  replicas' own (``r:ID:caps``), which ``PLACE`` holds it to (``caps``).

Every change of ``slots`` is published on ``freed`` (``FIELD\\tCOUNT`` lines),
so that every replica's view of the fleet follows within a round trip, and a
replica whose request waits first tries again at once.

The counts (``slots``, ``tenants``, ``waiting``) are kept by each script as
it goes, and rebuilt from the live replicas' own records by the heartbeat
(``heartbeat``), which heals whatever else a writer to Redis may have put
there.
"""

from __future__ import annotations

#: Shared by every script: numbers read safely, the clock, liveness, forgetting a replica.
#: Anything read from a key is checked before use (a writer to Redis may have put anything
#: there): ``num`` and ``whole`` give nil for what is not a finite number or a count, an
#: entry that does not parse is skipped, so that no value makes a script fail.
COMMON = """
local P, me = ARGV[1], ARGV[2]
local function num(s)
  local n = tonumber(s)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then return nil end
  return n
end
local function whole(s)
  local n = num(s)
  if n == nil or n < 0 or n > 9007199254740992 or n ~= math.floor(n) then return nil end
  return n
end
local function safe(...)
  local got = redis.pcall(...)
  if type(got) == 'table' and got.err then return nil end
  return got
end
local function members(key)
  local got = safe('SMEMBERS', key)
  if got == nil then
    redis.call('DEL', key)
    return {}
  end
  return got
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function alive(r, now)
  if r == nil then return false end
  local s = num(redis.call('ZSCORE', P .. 'alive', r))
  return s ~= nil and s > now
end
local function add(key, field, by)
  local n = (whole(redis.call('HGET', key, field)) or 0) + by
  if n <= 0 then
    redis.call('HDEL', key, field)
    return 0
  end
  redis.call('HSET', key, field, n)
  return n
end
local function bump(key, by)
  local n = math.max(0, (whole(redis.call('GET', key)) or 0) + by)
  redis.call('SET', key, n)
  return n
end
local function lease_field(e) return string.match(e, '^([^\\t\\n]+)|[^|\\t\\n]*$') end
local function tenant_of(e) return string.match(e, '^(.*)|[^|]*$') end
local function wait_of(e) return string.match(e, '^(.-)\\n(.-)\\n(.*)$') end
local function count(field, by)
  local n = add(P .. 'slots', field, by)
  bump(P .. 'version', 1)
  return n
end
local function version()
  return whole(redis.call('GET', P .. 'version')) or 0
end
local function publish(changed)
  if #changed > 0 then
    redis.call('PUBLISH', P .. 'freed', '#' .. version() .. '\\n' .. table.concat(changed, '\\n'))
  end
end
local function unwait(model, prio, member)
  local q = P .. 'q:' .. model .. ':' .. prio
  if safe('ZREM', q, member) ~= 1 then return false end
  bump(P .. 'waiting', -1)
  if safe('ZCARD', q) == 0 then redis.call('ZREM', P .. 'qp:' .. model, prio) end
  return true
end
local function forget(r, keep)
  local n, changed = 0, {}
  local leases = P .. 'r:' .. r .. ':leases'
  for _, e in ipairs(members(leases)) do
    local field = lease_field(e)
    if field then
      changed[#changed + 1] = field .. '\\t' .. count(field, -1)
      n = n + 1
    end
  end
  redis.call('DEL', leases)
  local waits = P .. 'r:' .. r .. ':waits'
  for _, e in ipairs(members(waits)) do
    local model, prio, member = wait_of(e)
    if model then unwait(model, prio, member) end
  end
  redis.call('DEL', waits)
  local tenants = P .. 'r:' .. r .. ':tenants'
  for _, e in ipairs(members(tenants)) do
    local t = tenant_of(e)
    if t then add(P .. 'tenants', t, -1) end
  end
  redis.call('DEL', tenants)
  if not keep then
    redis.call('DEL', P .. 'r:' .. r .. ':caps')
    redis.call('ZREM', P .. 'alive', r)
    redis.call('HDEL', P .. 'info', r)
  end
  publish(changed)
  return n
end
"""

# ARGV: prefix, replica, ttl (ms), its info, N, N lease entries (POOL|URL|LEASE), then
# tenant entries (TENANT|ID). What the replica holds now, in place of whatever Redis held
# for it (after Redis was away, or forgot it): no slot lost, none counted twice. Its
# waiting requests are entered again by the replica. Returns the slots' view.
RESTORE = (
    COMMON
    + """
local now = now_ms()
forget(me, true)
local n = tonumber(ARGV[5])
local changed = {}
for i = 6, 5 + n do
  local e = ARGV[i]
  local field = lease_field(e)
  if field then
    redis.call('SADD', P .. 'r:' .. me .. ':leases', e)
    changed[#changed + 1] = field .. '\\t' .. count(field, 1)
  end
end
for i = 6 + n, #ARGV do
  local e = ARGV[i]
  local t = tenant_of(e)
  if t then
    redis.call('SADD', P .. 'r:' .. me .. ':tenants', e)
    add(P .. 'tenants', t, 1)
  end
end
redis.call('ZADD', P .. 'alive', now + tonumber(ARGV[3]), me)
redis.call('HSET', P .. 'info', me, ARGV[4])
publish(changed)
return {redis.call('HGETALL', P .. 'slots'), version()}
"""
)

#: What ``PLACE`` answers first.
GRANTED, QUEUED, BLOCKED, NOT_FIRST, SHED, FULL = range(6)

# ARGV: prefix, replica, model, priority, member ('': a new request), tenant, weight,
# sheddable (0/1), queue size, local id, blocked pool ('': its instances chosen), then
# pairs of (FIELD, CAP) and the lease ids, decode's first:
#   12: decode FIELD, 13: decode cap, 14: decode lease, 15: prefill FIELD ('': none),
#   16: prefill cap, 17: prefill lease. A cap is this replica's; the fleet's (``caps``) holds
# when it is lower.
# A new request goes at once when nothing of its model waits (in any replica) and both its
# slots are free; else it waits in the fleet's order (or is shed, or the queue is full).
# A waiting one (``member``) goes when it is the first of its model and its slots are free.
# Answers {code, member or pool, the slots' view, waiting, the latest grant times (ms)}.
PLACE = (
    COMMON
    + """
local now = now_ms()
local model, prio, member = ARGV[3], ARGV[4], ARGV[5]
local function first()
  while true do
    local prios = redis.call('ZRANGE', P .. 'qp:' .. model, 0, 0)
    if #prios == 0 then return nil end
    local q = P .. 'q:' .. model .. ':' .. prios[1]
    local h = redis.call('ZRANGE', q, 0, 0)
    if #h == 0 then
      redis.call('ZREM', P .. 'qp:' .. model, prios[1])
    else
      local r = string.match(h[1], '^[^:]*:([^:]*):')
      local entry = model .. '\\n' .. prios[1] .. '\\n' .. h[1]
      if alive(r, now) and safe('SISMEMBER', P .. 'r:' .. r .. ':waits', entry) == 1 then
        return prios[1], h[1]
      end
      -- No live replica holds it: its replica died (it counts among those waiting), or
      -- someone else wrote it (it never did).
      if r and safe('SREM', P .. 'r:' .. r .. ':waits', entry) == 1 then
        unwait(model, prios[1], h[1])
      else
        redis.call('ZREM', q, h[1])
      end
    end
  end
end
local function answer(code, said)
  return {code, said, redis.call('HGETALL', P .. 'slots'),
          whole(redis.call('GET', P .. 'waiting')) or 0,
          redis.call('LRANGE', P .. 'grants', 0, -1), version()}
end
local function room(field, cap)
  if field == '' then return true end
  local c = tonumber(cap)
  local fleet = whole(safe('HGET', P .. 'caps', field))  -- (the lowest of the live replicas')
  if fleet and fleet > 0 and (c == 0 or fleet < c) then c = fleet end
  if c == 0 then return true end
  return (whole(redis.call('HGET', P .. 'slots', field)) or 0) < c
end
local fprio, fmember = first()
local vkey, lkey = P .. 'v', P .. 'last:' .. model
local tenant = ARGV[6]
if member ~= '' and fmember ~= member then return answer(3, '') end
if member == '' and fmember ~= nil and ARGV[8] == '1' then return answer(4, '') end
local blocked = ARGV[11]
local go = member ~= '' or fmember == nil
if go and blocked == '' then
  if not room(ARGV[12], ARGV[13]) then blocked = 'decode'
  elseif not room(ARGV[15], ARGV[16]) then blocked = 'prefill' end
end
if go and blocked == '' then
  local changed = {}
  for _, i in ipairs({12, 15}) do
    if ARGV[i] ~= '' then
      redis.call('SADD', P .. 'r:' .. me .. ':leases', ARGV[i] .. '|' .. ARGV[i + 2])
      changed[#changed + 1] = ARGV[i] .. '\\t' .. count(ARGV[i], 1)
    end
  end
  local v = num(redis.call('HGET', vkey, model)) or 0
  if member ~= '' then
    local finish = num(redis.call('ZSCORE', P .. 'q:' .. model .. ':' .. prio, member))
    unwait(model, prio, member)
    redis.call('SREM', P .. 'r:' .. me .. ':waits', model .. '\\n' .. prio .. '\\n' .. member)
    redis.call('HSET', vkey, model, math.max(v, finish or v))
  else
    local l = num(redis.call('HGET', lkey, tenant)) or 0
    local finish = math.max(v, l) + 1 / tonumber(ARGV[7])
    redis.call('HSET', vkey, model, finish)
    redis.call('HSET', lkey, tenant, finish)
  end
  redis.call('LPUSH', P .. 'grants', now)
  redis.call('LTRIM', P .. 'grants', 0, 63)
  publish(changed)
  if member ~= '' and redis.call('EXISTS', P .. 'qp:' .. model) == 1 then
    redis.call('PUBLISH', P .. 'freed', '')
  end
  return answer(0, '')
end
if member ~= '' then return answer(2, blocked) end
if ARGV[8] == '1' then return answer(4, '') end
if (whole(redis.call('GET', P .. 'waiting')) or 0) >= tonumber(ARGV[9]) then
  return answer(5, '')
end
local v = num(redis.call('HGET', vkey, model)) or 0
local l = num(redis.call('HGET', lkey, tenant)) or 0
local finish = math.max(v, l) + 1 / tonumber(ARGV[7])
redis.call('HSET', lkey, tenant, finish)
redis.call('HSETNX', vkey, model, v)  -- (the heartbeat trims the tags of the models in v)
local named = string.format('%016d', bump(P .. 'seq', 1)) .. ':' .. me .. ':' .. ARGV[10]
redis.call('ZADD', P .. 'q:' .. model .. ':' .. prio, finish, named)
redis.call('ZADD', P .. 'qp:' .. model, tonumber(prio), prio)
redis.call('SADD', P .. 'r:' .. me .. ':waits', model .. '\\n' .. prio .. '\\n' .. named)
bump(P .. 'waiting', 1)
if blocked == '' then blocked = 'queued' end
return answer(1, named .. '\\n' .. blocked .. '\\n' .. string.format('%.17g', finish))
"""
)

# ARGV: prefix, replica, model, priority, member. A waiting request leaves (timed out, its
# client gone, the replica stopping); when it was the first, the next may go.
LEAVE = (
    COMMON
    + """
local model, prio, member = ARGV[3], ARGV[4], ARGV[5]
local q = P .. 'q:' .. model .. ':' .. prio
local was = redis.call('ZRANGE', q, 0, 0)
if unwait(model, prio, member) then
  redis.call('SREM', P .. 'r:' .. me .. ':waits', model .. '\\n' .. prio .. '\\n' .. member)
  if was[1] == member then redis.call('PUBLISH', P .. 'freed', '') end
  return 1
end
return 0
"""
)

# ARGV: prefix, replica, lease entries (POOL|URL|LEASE). Legs that ended give their slots
# back; each once, however often asked. Returns how many were held.
RELEASE = (
    COMMON
    + """
local changed, n = {}, 0
for i = 3, #ARGV do
  local field = lease_field(ARGV[i])
  if field and redis.call('SREM', P .. 'r:' .. me .. ':leases', ARGV[i]) == 1 then
    changed[#changed + 1] = field .. '\\t' .. count(field, -1)
    n = n + 1
  end
end
publish(changed)
return n
"""
)

# ARGV: prefix, replica, tenant, limit, id. One more request of ``tenant`` in flight, if
# under ``limit`` over every replica: {1} taken, {0, count} refused.
TENANT_IN = (
    COMMON
    + """
local n = whole(redis.call('HGET', P .. 'tenants', ARGV[3])) or 0
if n >= tonumber(ARGV[4]) then return {0, n} end
add(P .. 'tenants', ARGV[3], 1)
redis.call('SADD', P .. 'r:' .. me .. ':tenants', ARGV[3] .. '|' .. ARGV[5])
return {1}
"""
)

# ARGV: prefix, replica, tenant, id. That request ended (once, however often asked).
TENANT_OUT = (
    COMMON
    + """
if redis.call('SREM', P .. 'r:' .. me .. ':tenants', ARGV[3] .. '|' .. ARGV[4]) == 1 then
  add(P .. 'tenants', ARGV[3], -1)
  return 1
end
return 0
"""
)
