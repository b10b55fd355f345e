"""The fleet's queue in ``--replicas-redis``: ``PLACE`` and ``LEAVE``, each called by name.

``PLACE`` lets a new request in (granted, queued in the fleet's order or refused; the
queue full, the request that order lets go last pushed out for it) and a waiting one go
with its slots; ``LEAVE`` lets one leave unserved. Both give a tenant its tag back
(``GIVE_BACK``), so both are written here. In: ``PlaceAsk``; out: ``PlaceReply``. The
keys are ``scripts``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

from twisted.internet.defer import Deferred

from nixl_twisted.fleet.lua_common import COMMON, Caller
from nixl_twisted.fleet.replies import WrongReply, count_of, number_of, text, view_of

# ``push_out(p, lag)``, ``PLACE``'s when the queue is full: ``p`` and ``lag`` are the
# newcomer's priority and finish tag past its model's clock (``v``). Last is the largest
# (priority, tag past its model's clock, arrival) over every model (each model keeps its
# own clock: a tag is compared by how far ahead of it it is; a member's arrival is its
# ``seq``, its first field); the newcomer came last, so a tie is its. Answers the member
# pushed out, or nil when the newcomer would be last. An entry no replica holds is dropped
# on the way (it never counted). A ready lane (a model key with a tab) is never scanned.
# ``give_back(model, prio, member, f)``: a waiting request tagged ``f`` leaves unserved
# (pushed out, timed out, its client gone): its tenant is charged nothing for it. Its
# tenant's later requests in that queue move back one step, and so does its last tag; the
# member's tail holds the step (``1 / weight``) and the tenant (none: nothing moves). Else
# a tenant whose requests keep timing out falls ever further behind the clock.
GIVE_BACK = """
local function give_back(model, prio, member, f)
  local step, t = string.match(member, '^[^:]*:[^:]*:[^:]*:([^:]*):(.*)$')
  step = num(step)
  if not step or step <= 0 or not f then return false end
  local moved = false
  local qk = P .. 'q:' .. model .. ':' .. prio
  local later = safe('ZRANGEBYSCORE', qk, '(' .. string.format('%.17g', f), '+inf',
                     'WITHSCORES') or {}
  for i = 1, #later, 2 do
    local m, g = later[i], num(later[i + 1])
    local _, mt = string.match(m, '^[^:]*:[^:]*:[^:]*:([^:]*):(.*)$')
    if g and mt == t then
      redis.call('ZADD', qk, 'XX', g - step, m)
      moved = true
    end
  end
  local lk = P .. 'last:' .. model
  local l = num(safe('HGET', lk, t))
  if l and l >= f then redis.call('HSET', lk, t, l - step) end
  return moved
end
"""

PUSH_OUT = """
local function later(a, b)  -- (priority, lag, member: nil for a newcomer, the latest)
  if a[1] ~= b[1] then return a[1] > b[1] end
  if a[2] ~= b[2] then return a[2] > b[2] end
  return b[3] ~= nil and a[3] > b[3]
end
local function push_out(p, lag)
  while true do
    local worst
    local clocks = safe('HGETALL', P .. 'v') or {}
    for i = 1, #clocks, 2 do
      local m, mv = clocks[i], num(clocks[i + 1]) or 0
      local lanes = {}  -- (a ready lane's requests, prefilled, never leave for room)
      if not string.find(m, '\t', 1, true) then
        lanes = safe('ZREVRANGE', P .. 'qp:' .. m, 0, -1) or {}
      end
      for _, q in ipairs(lanes) do
        local got = safe('ZRANGE', P .. 'q:' .. m .. ':' .. q, -1, -1, 'WITHSCORES')
        if tonumber(q) and got and #got == 2 then
          local f = num(got[2]) or 0
          local key = {tonumber(q), f - mv, got[1], m, q, f}
          if worst == nil or later(key, worst) then worst = key end
          break
        end
      end
    end
    if worst == nil or not later(worst, {p, lag}) then return nil end
    local pushed, m, q, f = worst[3], worst[4], worst[5], worst[6]
    local r = string.match(pushed, '^[^:]*:([^:]*):')
    if r and safe('SREM', P .. 'r:' .. r .. ':waits', m .. '\\n' .. q .. '\\n' .. pushed) == 1 then
      unwait(m, q, pushed)
      safe('SADD', P .. 'r:' .. r .. ':pushed', pushed)
      if give_back(m, q, pushed, f) then  -- (a request moved up may be the first now)
        redis.call('PUBLISH', P .. 'freed', '')
      end
      redis.call('PUBLISH', P .. 'freed', 'pushed\\n' .. pushed)
      return pushed
    end
    local qk = P .. 'q:' .. m .. ':' .. q
    redis.call('ZREM', qk, pushed)  -- (no replica holds it: it never counted)
    if safe('ZCARD', qk) == 0 then redis.call('ZREM', P .. 'qp:' .. m, q) end
  end
end
"""


class PlaceCode(IntEnum):
    """What ``PLACE`` answers first."""

    GRANTED = 0
    QUEUED = 1
    BLOCKED = 2
    NOT_FIRST = 3
    SHED = 4
    FULL = 5
    #: The waiting request was pushed out of the full queue for a newcomer (its replica
    #: missed the message that said so).
    PUSHED = 6


GRANTED, QUEUED, BLOCKED, NOT_FIRST, SHED, FULL, PUSHED = PlaceCode

# ARGV: prefix, replica, model, priority, member ('': a new request), tenant, weight,
# sheddable (0/1), queue size, local id, blocked pool ('': its instances chosen), then
# pairs of (FIELD, CAP) and the lease ids, decode's first:
#   12: decode FIELD, 13: decode cap, 14: decode lease, 15: prefill FIELD ('': none),
#   16: prefill cap, 17: prefill lease. A cap is this replica's; the fleet's (``caps``) holds
# when it is lower. 18: in a ready lane, the seconds the request is due in (its first-token
# target, or the lease's 30 s): its place there is the time it is due, earliest first.
# A new request goes at once when nothing of its model waits (in any replica) and both its
# slots are free; else it waits in the fleet's order (or is shed). With the queue full, the
# fleet's last waiting request in that order (the largest priority, finish tag past its
# model's clock, arrival: over every model) is pushed out for it, unless it would be last
# itself (refused): the pushed one's replica is told on ``freed`` (``pushed`` then its
# member; ``r:ID:pushed`` keeps it until the replica tries it or lets it go), and its tenant
# is charged nothing for it (``give_back``: the member's tail holds its step and tenant).
# A waiting one (``member``) goes when it is the first of its model and its slots are
# free. A ready lane's requests are tagged at its clock: first come, first served.
# A model key with a tab is a model's ready lane (``admission.waiting.ready_key``): its grants
# are not requests started (``grants``, the drain rate).
# A change to a ready lane (a request queued in it or let go from it) is published on
# ``freed`` as a line ``LANE\tCOUNT``: the requests in it now (``fleet_ahead``).
# Answers {code, member or pool, the slots' view, waiting, the latest grant times (ms),
# version, the requests in the model's ready lane}.
PLACE = (
    COMMON
    + GIVE_BACK
    + PUSH_OUT
    + """
local now = now_ms()
local model, prio, member = ARGV[3], ARGV[4], ARGV[5]
local lane = model
if string.sub(model, -6) ~= '\tready' then lane = model .. '\tready' end
local function ready()
  local n = 0
  for _, q in ipairs(safe('ZRANGE', P .. 'qp:' .. lane, 0, -1) or {}) do
    n = n + (safe('ZCARD', P .. 'q:' .. lane .. ':' .. q) or 0)
  end
  return n
end
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
          redis.call('LRANGE', P .. 'grants', 0, -1), version(), ready()}
end
local function room(field, cap)
  if field == '' then return true end
  local c = tonumber(cap)
  local fleet = whole(safe('HGET', P .. 'caps', field))  -- (the lowest of the live replicas')
  if fleet and fleet > 0 and (c == 0 or fleet < c) then c = fleet end
  if c == 0 then return true end
  return (whole(redis.call('HGET', P .. 'slots', field)) or 0) < c
end
if member ~= '' and safe('SREM', P .. 'r:' .. me .. ':pushed', member) == 1 then
  return answer(6, '')
end
local fprio, fmember = first()
local vkey, lkey = P .. 'v', P .. 'last:' .. model
local tenant = ARGV[6]
if member ~= '' and fmember ~= member then return answer(3, fmember or '') end
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
  elseif lane ~= model then
    local l = num(redis.call('HGET', lkey, tenant)) or 0
    local finish = math.max(v, l) + 1 / tonumber(ARGV[7])
    redis.call('HSET', vkey, model, finish)
    redis.call('HSET', lkey, tenant, finish)
  end
  if not string.find(model, '\t', 1, true) then  -- (a ready lane's: not a request started)
    redis.call('LPUSH', P .. 'grants', now)
    redis.call('LTRIM', P .. 'grants', 0, 63)
  end
  if lane == model then changed[#changed + 1] = lane .. '\t' .. ready() end
  publish(changed)
  if member ~= '' and redis.call('EXISTS', P .. 'qp:' .. model) == 1 then
    redis.call('PUBLISH', P .. 'freed', '')
  end
  return answer(0, '')
end
if member ~= '' then return answer(2, blocked) end
if ARGV[8] == '1' then return answer(4, '') end
local v = num(redis.call('HGET', vkey, model)) or 0
local step = 1 / tonumber(ARGV[7])
local start = math.max(v, num(redis.call('HGET', lkey, tenant)) or 0)
if lane == model then  -- (a ready lane: earliest deadline first)
  start, step = now / 1000 + (tonumber(ARGV[18]) or 30), 0
end
local finish = start + step
local pushed = ''
if (whole(redis.call('GET', P .. 'waiting')) or 0) >= tonumber(ARGV[9]) then
  pushed = push_out(tonumber(prio), finish - v)
  if pushed == nil then return answer(5, '') end
end
if lane ~= model then redis.call('HSET', lkey, tenant, finish) end
redis.call('HSETNX', vkey, model, v)  -- (the heartbeat trims the tags of the models in v)
local named = string.format('%016d', bump(P .. 'seq', 1)) .. ':' .. me .. ':' .. ARGV[10]
if not string.find(tenant, '\\n', 1, true) then
  named = named .. ':' .. string.format('%.17g', step) .. ':' .. tenant
end
redis.call('ZADD', P .. 'q:' .. model .. ':' .. prio, finish, named)
redis.call('ZADD', P .. 'qp:' .. model, tonumber(prio), prio)
redis.call('SADD', P .. 'r:' .. me .. ':waits', model .. '\\n' .. prio .. '\\n' .. named)
bump(P .. 'waiting', 1)
if lane == model then publish({lane .. '\t' .. ready()}) end
if blocked == '' then blocked = 'queued' end
return answer(1, named .. '\\n' .. blocked .. '\\n' .. string.format('%.17g', finish) .. '\\n'
                .. pushed)
"""
)

# ARGV: prefix, replica, model, priority, member. A waiting request leaves (timed out, its
# client gone, the replica stopping, pushed out); when it was the first, the next may go.
LEAVE = (
    COMMON
    + GIVE_BACK
    + """
local model, prio, member = ARGV[3], ARGV[4], ARGV[5]
local q = P .. 'q:' .. model .. ':' .. prio
local was = redis.call('ZRANGE', q, 0, 0)
local f = num(safe('ZSCORE', q, member))
if unwait(model, prio, member) then
  local moved = give_back(model, prio, member, f)
  redis.call('SREM', P .. 'r:' .. me .. ':waits', model .. '\\n' .. prio .. '\\n' .. member)
  -- (the first left, or one moved up may be the first now: whoever holds it tries it)
  if was[1] == member or moved then redis.call('PUBLISH', P .. 'freed', '') end
  return 1
end
safe('SREM', P .. 'r:' .. me .. ':pushed', member)  -- (pushed out: its replica heard)
return 0
"""
)


class SlotAsk(NamedTuple):
    """What ``PLACE`` is told of one leg's slot: its instance (``POOL|URL``; "" for none or
    no cap), this replica's cap of it and the lease's new id."""

    field: str
    cap: int
    lease: str


NO_SLOT = SlotAsk("", 0, "")


@dataclass(frozen=True)
class PlaceAsk:
    """``PLACE``'s arguments after the prefix and the replica, by name."""

    #: The model whose queue it waits in ("" for those that name no served model).
    model: str
    priority: int
    #: Its place in the fleet's queue, "" when new.
    member: str
    tenant: str
    weight: float
    sheddable: bool
    queue_size: int
    #: This replica's own id of the request.
    order: int
    #: The pool this replica sees full ("" when its instances were chosen).
    blocked: str
    decode: SlotAsk
    prefill: SlotAsk
    #: In a ready lane, the seconds it is due in (its first-token target, else 30).
    due: float = 30.0

    def args(self) -> list[object]:
        return [
            self.model,
            self.priority,
            self.member,
            self.tenant,
            self.weight,
            1 if self.sheddable else 0,
            self.queue_size,
            self.order,
            self.blocked,
            *self.decode,
            *self.prefill,
            self.due,
        ]


@dataclass(frozen=True)
class PlaceReply:
    """What ``PLACE`` answered, each part checked (``read_place``)."""

    code: PlaceCode
    #: The fleet's slots (``POOL|URL`` -> legs) as of ``version``.
    view: dict[str, int]
    version: int
    #: Requests waiting in the fleet's queue, and when the latest were let go (ms, newest
    #: first).
    waiting: int
    grants: list[float]
    #: Queued: its place in the fleet's queue and its finish tag (not first: the member that
    #: is); queued or blocked: the pool it found full ("" when none).
    member: str = ""
    finish: float = 0.0
    blocked: str = ""
    #: Queued: the member pushed out of the full queue for it ("" when none).
    pushed: str = ""
    #: The requests in the ready lane of its model, prefilled and waiting for decode.
    ready: int = 0


def place(caller: Caller, ask: PlaceAsk) -> Deferred[PlaceReply]:
    """Run ``PLACE``: the request given its slots, queued, or refused."""
    return caller.call(PLACE, ask.args(), "place", read_place)


def read_place(reply: Any) -> PlaceReply:
    """``PLACE``'s reply (``WrongReply`` when any part is not as the script writes it)."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 7:
        raise WrongReply(reply)
    code, said, view, waiting, grants, version, ready = reply
    # (An integer reply: the script's own codes are never text, and never a boolean.)
    if not isinstance(code, int) or isinstance(code, bool) or not GRANTED <= code <= PUSHED:
        raise WrongReply(reply)
    if not isinstance(grants, (list, tuple)):
        raise WrongReply(reply)
    read = (PlaceCode(code), view_of(view), count_of(version), count_of(waiting))
    grant_times = [number_of(g) for g in grants]
    in_lane = count_of(ready)
    if code == BLOCKED:
        return PlaceReply(*read, grant_times, blocked=text(said), ready=in_lane)
    if code == NOT_FIRST:  # (the member that is first: its replica's to try)
        return PlaceReply(*read, grant_times, member=text(said), ready=in_lane)
    if code != QUEUED:
        return PlaceReply(*read, grant_times, ready=in_lane)
    parts = text(said).split("\n")
    if len(parts) != 4 or not parts[0]:
        raise WrongReply(reply)
    member, pool, finish, pushed = parts
    blocked = "" if pool == "queued" else pool
    finished = number_of(finish)
    return PlaceReply(*read, grant_times, member, finished, blocked, pushed, in_lane)


def leave(caller: Caller, model: str, priority: int | str, member: str) -> Deferred[Any]:
    """Run ``LEAVE``: a waiting request leaves the fleet's queue."""
    return caller.call(LEAVE, [model, priority, member], "leave", _as_is)


def _as_is(reply: Any) -> Any:
    return reply
