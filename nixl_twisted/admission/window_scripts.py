"""The two ``--limits-redis`` scripts, each called through one function with named
arguments and its reply read into a frozen value (``SharedWindows`` decides with it)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import IntEnum

from twisted.internet.defer import Deferred

from nixl_twisted.fleet.lua_common import Evaluates
from nixl_twisted.fleet.replies import WrongReply

WINDOW_MS = 60_000


#: Shared by both scripts: what a key holds is checked before use (anyone who can write to
#: Redis may have written there). A key of the wrong type is deleted; a count that is not a
#: whole number is 0; an entry dated after the window's end (no process dates one so) leaves
#: it; a total with no expiry (no script writes one so) or not a count is summed again from
#: the requests' own tokens. Each key expires with the window: whatever was forged is gone
#: within two windows at most.
_CHECKED = """
local function whole(s)
  local n = tonumber(s)
  if n == nil or n ~= n or n < 0 or n > 9007199254740992 or n ~= math.floor(n) then return nil end
  return n
end
local function typed(key, kind)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= kind then redis.call('DEL', key) end
end
local function total(tokens, used, sum, window)
  local n = whole(redis.call('GET', sum))
  if n == nil or redis.call('PTTL', sum) == -1 then
    n = 0
    for _, v in ipairs(redis.call('HVALS', used)) do n = n + (whole(v) or 0) end
    redis.call('SET', sum, n, 'PX', window)
  end
  return n
end
"""

# KEYS: requests (zset), tokens (zset), tokens by member (hash), their total.
# ARGV: now (ms), window (ms), requests limit, tokens limit, estimate (-1: none), member.
# {0}: admitted; {1, oldest}: past the requests; {2, oldest}: past the tokens.
ADMIT = (
    _CHECKED
    + """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local since, later = now - window, '(' .. (now + window)
local rpm, tpm, estimate = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local counted = tpm > 0 and estimate >= 0
typed(KEYS[1], 'zset')
typed(KEYS[2], 'zset')
typed(KEYS[3], 'hash')
typed(KEYS[4], 'string')
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', since)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], later, '+inf')
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    return {1, redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]}
  end
end
if counted then
  local used = total(KEYS[2], KEYS[3], KEYS[4], window)
  local freed = 0
  for _, range in ipairs({{'-inf', since}, {later, '+inf'}}) do
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], range[1], range[2])) do
      freed = freed + (whole(redis.call('HGET', KEYS[3], member)) or 0)
      redis.call('HDEL', KEYS[3], member)
      redis.call('ZREM', KEYS[2], member)
    end
  end
  used = math.max(0, used - freed)
  redis.call('SET', KEYS[4], used, 'PX', window)
  if used > 0 and used + estimate > tpm then
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    return {2, oldest[2] or ARGV[1]}
  end
end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[6])
  redis.call('PEXPIRE', KEYS[1], window)
end
if counted then
  redis.call('ZADD', KEYS[2], now, ARGV[6])
  redis.call('HSET', KEYS[3], ARGV[6], estimate)
  redis.call('SET', KEYS[4], total(KEYS[2], KEYS[3], KEYS[4], window) + estimate, 'PX', window)
  for i = 2, 3 do redis.call('PEXPIRE', KEYS[i], window) end
end
return {0}
"""
)

# KEYS: tokens (zset), tokens by member (hash), their total.
# ARGV: now (ms), window (ms), member, tokens. The estimate becomes what was used,
# counted from now; one that already left the window is charged afresh.
CHARGE = (
    _CHECKED
    + """
local window = tonumber(ARGV[2])
typed(KEYS[1], 'zset')
typed(KEYS[2], 'hash')
typed(KEYS[3], 'string')
local used = total(KEYS[1], KEYS[2], KEYS[3], window)
local before = whole(redis.call('HGET', KEYS[2], ARGV[3])) or 0
local tokens = tonumber(ARGV[4])
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]), ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], tokens)
redis.call('SET', KEYS[3], math.max(0, used + tokens - before), 'PX', window)
for i = 1, 2 do redis.call('PEXPIRE', KEYS[i], window) end
return 1
"""
)


class WindowOutcome(IntEnum):
    """What ``ADMIT`` answers first."""

    ADMITTED = 0
    PAST_REQUESTS = 1
    PAST_TOKENS = 2


@dataclass(frozen=True)
class WindowAsk:
    """``ADMIT``'s arguments: when (ms), the tenant's limits, its estimate and its name."""

    now_ms: int
    rpm: int
    tpm: int
    #: The request's tokens as estimated (None: none).
    estimate: int | None
    member: str


@dataclass(frozen=True)
class WindowReply:
    """What ``ADMIT`` answered: admitted, or past which limit and the oldest entry's time."""

    outcome: WindowOutcome
    oldest: float = 0.0


def window_keys(tenant: str) -> list[str]:
    """A tenant's keys (requests, tokens, tokens by member, their total): one hash slot."""
    tag = hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16]
    return [f"nixlproxy:{{{tag}}}:{name}" for name in ("requests", "tokens", "used", "total")]


def admit_window(link: Evaluates, keys: list[str], ask: WindowAsk) -> Deferred[WindowReply]:
    """Run ``ADMIT``: the request counted in its tenant's windows, or refused."""
    estimate = -1 if ask.estimate is None else ask.estimate
    args = [ask.now_ms, WINDOW_MS, ask.rpm, ask.tpm, estimate, ask.member]
    return link.eval(ADMIT, keys, args).addCallback(read_admitted)


def charge_window(
    link: Evaluates, keys: list[str], member: str, tokens: int, now_ms: int
) -> Deferred[None]:
    """Run ``CHARGE``: what an admitted request used, in place of its estimate."""
    sent = link.eval(CHARGE, keys[1:], [now_ms, WINDOW_MS, member, tokens])
    return sent.addCallback(_charged)


def read_admitted(answer: object) -> WindowReply:
    """``ADMIT``'s answer: its outcome and, when refused, the oldest score."""
    if isinstance(answer, list) and answer and type(answer[0]) is int:
        if answer == [0]:
            return WindowReply(WindowOutcome.ADMITTED)
        if answer[0] in (1, 2) and len(answer) == 2 and type(answer[1]) in (int, float, str):
            try:
                oldest = float(answer[1])
            except ValueError:
                raise WrongReply(answer) from None
            if math.isfinite(oldest):
                return WindowReply(WindowOutcome(answer[0]), oldest)
    raise WrongReply(answer)


def _charged(answer: object) -> None:
    if answer != 1:
        raise WrongReply(answer)
