"""``--limits-redis``: each tenant's requests and tokens per minute, counted in one Redis.

Every replica and worker then holds a tenant to one limit. Each admission is
one Lua script (sent by its SHA-1 once known, txredisapi's ``eval``) that
forgets what left the 60 s window, decides and counts, atomically; the keys
are ``nixlproxy:{<tenant's digest>}:...`` (one hash slot per tenant) and
expire with the window. A request's tokens enter the window as its estimate
when it is admitted, and are replaced by what vLLM reported when it ends: a
replica that dies leaves estimates that simply leave the window.

Requests in flight stay counted in each process: a count shared in Redis
would be given back by the process that took it, and a process that dies or
loses Redis mid-request would hold it for good (``security.md``).

Redis must never fail a request: a call not answered within ``TIMEOUT`` s,
any error, or a reply of the wrong shape lets the process decide with its
own counters, said in words once per change of state (the log,
``nixlproxy_tenant_limits_fallback``) and counted for each request
(``nixlproxy_tenant_limits_decided_alone_total``). While Redis is known
unreachable no call is tried; its connection comes back on its own
(``redis_link``), refused ones included.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.config.words import counted
from nixl_twisted.fleet.link import RETRY, RedisLink
from nixl_twisted.observe.metrics import ProxyMetrics

log = Logger()

#: Seconds a Redis call may take before the process decides alone.
TIMEOUT = 0.1
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


@dataclass(frozen=True)
class Verdict:
    """What Redis decided: admitted, or past which limit and for how many seconds more."""

    admitted: bool
    limit: str = ""
    wait: float = 0.0
    #: The request's name in Redis (its tokens are charged under it).
    member: str = ""


class WrongReply(Exception):
    """Redis answered a script with a reply of another shape than the script's."""

    def __init__(self, reply: object) -> None:
        shown = repr(reply)
        super().__init__(shown if len(shown) <= 80 else shown[:77] + "...")


class SharedWindows(Service):
    """Requests and tokens per minute in Redis, for every process; None when Redis cannot say."""

    def __init__(
        self, url: str, clock: IReactorTime, timer: IReactorTime, metrics: ProxyMetrics
    ) -> None:
        """``clock``: the proxy's time (the windows', and the wait before a refused
        connection is made again); ``timer``: the reactor, for the timeout of each
        call (network time, not the proxy's)."""
        self.url = url
        self.clock = clock
        self.timer = timer
        self.metrics = metrics
        #: Each process's requests have names of their own.
        self._names = (f"{uuid.uuid4().hex[:12]}:{n}" for n in itertools.count())
        self.fallback = False
        #: The connection, opened at the start of the service (before the listeners').
        self.link = RedisLink(url, clock, self._refused)

    def startService(self) -> None:
        super().startService()
        self.link.start()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return self.link.stop()

    def admit(
        self, tenant: str, rpm: int, tpm: int, estimate: int | None
    ) -> Deferred[Verdict | None]:
        """Count a request for ``tenant`` in Redis; None: Redis could not say in time."""
        if self.fallback and not self.link.open:
            self._decided_alone("not_connected")
            return succeed(None)  # (known unreachable: no call, no wait)
        now = self._now_ms()
        member = next(self._names)
        sent = self.link.eval(
            ADMIT,
            _keys(tenant),
            [now, WINDOW_MS, rpm, tpm, -1 if estimate is None else estimate, member],
        )

        def decided(answer: object) -> Verdict:
            code, oldest = _admission(answer)
            self._shared()
            if code == 0:
                return Verdict(True, member=member)
            # (clocks may differ; no entry stays past two windows: ``_CHECKED``)
            wait = min(2 * WINDOW_MS / 1000, max(1.0, (oldest + WINDOW_MS - now) / 1000))
            limit = (
                f"{counted(rpm, 'request')} per minute"
                if code == 1
                else f"{counted(tpm, 'token')} per minute"
            )
            return Verdict(False, limit, wait)

        def alone(failure: Failure) -> None:
            if failure.check(CancelledError):
                failure.raiseException()  # (its client left: nothing said of Redis)
            reason, what = _why(failure, self.link.open)
            self._decided_alone(reason)
            self._away(what)

        return self._bounded(sent).addCallback(decided).addErrback(alone)

    def charge(self, tenant: str, member: str, tokens: int) -> None:
        """What an admitted request used, in place of its estimate (best effort)."""
        if self.fallback and not self.link.open:
            return  # (its estimate leaves the window on its own)
        sent = self.link.eval(
            CHARGE, _keys(tenant)[1:], [self._now_ms(), WINDOW_MS, member, tokens]
        )

        def charged(answer: object) -> None:
            if answer != 1:
                raise WrongReply(answer)
            self._shared()

        def failed(failure: Failure) -> None:
            if not failure.check(CancelledError):
                self._away(_why(failure, self.link.open)[1])

        self._bounded(sent).addCallback(charged).addErrback(failed)

    def connected(self) -> Deferred[None]:
        """Fires when a connection to Redis is next made (for tests and operators)."""
        return self.link.connected()

    def _now_ms(self) -> int:
        return int(self.clock.seconds() * 1000)

    def _bounded(self, sent: Deferred[Any]) -> Deferred[Any]:
        return sent.addTimeout(TIMEOUT, self.timer)

    def _decided_alone(self, reason: str) -> None:
        self.metrics.tenant_limits_decided_alone.labels(reason=reason).inc()

    def _refused(self, why: str) -> None:
        self._away(f"refused the connection ({why}; tried again every {RETRY:g} s)")

    def _shared(self) -> None:
        if self.fallback:
            self.fallback = False
            self.metrics.tenant_limits_fallback.set(0)
            log.info(
                "tenant limits: Redis {url} answers again; limits are shared", url=_shown(self.url)
            )

    def _away(self, what: str) -> None:
        if not self.fallback:
            self.fallback = True
            self.metrics.tenant_limits_fallback.set(1)
            log.warn(
                "tenant limits: Redis {url} {what}; each process counts its own requests and "
                "tokens per minute until it answers again",
                url=_shown(self.url),
                what=what,
            )


def _admission(answer: object) -> tuple[int, float]:
    """The script's answer: its code (0, 1 or 2) and, when refused, the oldest score."""
    if isinstance(answer, list) and answer and type(answer[0]) is int:
        if answer == [0]:
            return 0, 0.0
        if answer[0] in (1, 2) and len(answer) == 2 and type(answer[1]) in (int, float, str):
            try:
                oldest = float(answer[1])
            except ValueError:
                raise WrongReply(answer) from None
            if math.isfinite(oldest):
                return answer[0], oldest
    raise WrongReply(answer)


def _why(failure: Failure, connected: bool) -> tuple[str, str]:
    """Why Redis could not say: the reason counted, and what the log says, in words."""
    message = failure.getErrorMessage()
    if failure.check(defer.TimeoutError):
        if connected:
            return "timeout", f"did not answer within {TIMEOUT * 1000:g} ms"
        return "not_connected", f"could not be reached (no connection within {TIMEOUT * 1000:g} ms)"
    if failure.check(WrongReply, "txredisapi.InvalidResponse"):
        return "wrong_reply", f"answered with a reply of the wrong shape ({message})"
    if failure.check("txredisapi.ConnectionError"):
        return "not_connected", f"could not be reached ({message})"
    if failure.check("txredisapi.ResponseError"):
        return "error", f"answered with an error ({message})"
    return "error", f"failed ({type(failure.value).__name__}: {message})"


def _keys(tenant: str) -> list[str]:
    tag = hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16]
    return [f"nixlproxy:{{{tag}}}:{name}" for name in ("requests", "tokens", "used", "total")]


def _shown(url: str) -> str:
    """The URL without its password, as the log may show it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"
