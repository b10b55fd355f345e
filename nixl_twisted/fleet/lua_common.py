"""What every ``--replicas-redis`` script begins with, and what runs one (``scripts`` names
the keys)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred

T = TypeVar("T")


class Caller(Protocol):
    """Who runs a script with this replica's prefix and id first (``Replicas.call``)."""

    def call(
        self, script: str, args: Sequence[object], name: str, read: Callable[[Any], T]
    ) -> Deferred[T]: ...


class Evaluates(Protocol):
    """The connection a script runs on (``RedisLink``)."""

    def eval(self, script: str, keys: list[str], args: list[Any]) -> Deferred[Any]: ...


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
  redis.call('DEL', P .. 'r:' .. r .. ':pushed')
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
