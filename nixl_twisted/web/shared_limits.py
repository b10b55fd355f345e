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
or any error, lets the process decide with its own counters, said once per
change of state (the log, ``nixlproxy_tenant_limits_fallback``). While Redis
is known unreachable no call is tried; its connection comes back on its own.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()

#: Seconds a Redis call may take before the process decides alone.
TIMEOUT = 0.1
WINDOW_MS = 60_000

# KEYS: requests (zset), tokens (zset), tokens by member (hash), their total.
# ARGV: now (ms), window (ms), requests limit, tokens limit, estimate (-1: none), member.
# {0}: admitted; {1, oldest}: past the requests; {2, oldest}: past the tokens.
ADMIT = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local since = now - window
local rpm, tpm, estimate = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local counted = tpm > 0 and estimate >= 0
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', since)
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    return {1, redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]}
  end
end
if counted then
  local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', since)
  if #gone > 0 then
    local freed = 0
    for _, member in ipairs(gone) do
      freed = freed + (tonumber(redis.call('HGET', KEYS[3], member)) or 0)
      redis.call('HDEL', KEYS[3], member)
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', since)
    redis.call('DECRBY', KEYS[4], freed)
  end
  local used = tonumber(redis.call('GET', KEYS[4])) or 0
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
  redis.call('INCRBY', KEYS[4], estimate)
  for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], window) end
end
return {0}
"""

# KEYS: tokens (zset), tokens by member (hash), their total.
# ARGV: now (ms), window (ms), member, tokens. The estimate becomes what was used,
# counted from now; one that already left the window is charged afresh.
CHARGE = """
local before = tonumber(redis.call('HGET', KEYS[2], ARGV[3])) or 0
local tokens = tonumber(ARGV[4])
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]), ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], tokens)
redis.call('INCRBY', KEYS[3], tokens - before)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[2])) end
return 1
"""


@dataclass(frozen=True)
class Verdict:
    """What Redis decided: admitted, or past which limit and for how many seconds more."""

    admitted: bool
    limit: str = ""
    wait: float = 0.0
    #: The request's name in Redis (its tokens are charged under it).
    member: str = ""


class SharedWindows(Service):
    """Requests and tokens per minute in Redis, for every process; None when Redis cannot say."""

    def __init__(
        self,
        url: str,
        clock: IReactorTime,
        timer: IReactorTime,
        on_fallback: Callable[[bool], None],
    ) -> None:
        """``clock``: the proxy's time (the windows'); ``timer``: the reactor, for the
        timeout of each call (network time, not the proxy's)."""
        self.url = url
        self.clock = clock
        self.timer = timer
        self.on_fallback = on_fallback
        #: Each process's requests have names of their own.
        self._names = (f"{uuid.uuid4().hex[:12]}:{n}" for n in itertools.count())
        self.fallback = False
        self._waiting: list[Deferred[None]] = []
        #: txredisapi's connection, from the start of the service (before the listeners').
        self.redis: Any = None

    def startService(self) -> None:
        super().startService()
        self.redis = _connect(self.url, self._connected)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        closing: Deferred[None] = self.redis.disconnect()
        return closing.addErrback(lambda _: None)

    def admit(
        self, tenant: str, rpm: int, tpm: int, estimate: int | None
    ) -> Deferred[Verdict | None]:
        """Count a request for ``tenant`` in Redis; None: Redis could not say in time."""
        if self.fallback and not self._factory.size:
            return succeed(None)  # (known unreachable: no call, no wait)
        now = self._now_ms()
        member = next(self._names)
        sent = self.redis.eval(
            ADMIT,
            _keys(tenant),
            [now, WINDOW_MS, rpm, tpm, -1 if estimate is None else estimate, member],
        )

        def decided(answer: list[Any]) -> Verdict:
            self._shared()
            if int(answer[0]) == 0:
                return Verdict(True, member=member)
            wait = max(1.0, (float(answer[1]) + WINDOW_MS - now) / 1000)  # (clocks may differ)
            limit = (
                f"{rpm} requests per minute" if int(answer[0]) == 1 else f"{tpm} tokens per minute"
            )
            return Verdict(False, limit, wait)

        return self._bounded(sent).addCallbacks(decided, self._failed)

    def charge(self, tenant: str, member: str, tokens: int) -> None:
        """What an admitted request used, in place of its estimate (best effort)."""
        if self.fallback and not self._factory.size:
            return  # (its estimate leaves the window on its own)
        sent = self.redis.eval(
            CHARGE, _keys(tenant)[1:], [self._now_ms(), WINDOW_MS, member, tokens]
        )
        self._bounded(sent).addCallbacks(lambda _: self._shared(), self._failed)

    def connected(self) -> Deferred[None]:
        """Fires when a connection to Redis is next made (for tests and operators)."""
        waiting: Deferred[None] = Deferred()
        self._waiting.append(waiting)
        return waiting

    @property
    def _factory(self) -> Any:
        # (txredisapi's handler keeps its factory private; its size is the
        # connections open now, which says whether a call can be sent at all)
        return self.redis._factory

    def _connected(self) -> None:
        waiting, self._waiting = self._waiting, []
        for each in waiting:
            each.callback(None)

    def _now_ms(self) -> int:
        return int(self.clock.seconds() * 1000)

    def _bounded(self, sent: Deferred[Any]) -> Deferred[Any]:
        return sent.addTimeout(TIMEOUT, self.timer)

    def _shared(self) -> None:
        if self.fallback:
            self.fallback = False
            self.on_fallback(False)
            log.info(
                "tenant limits: Redis {url} answers again; limits are shared", url=_shown(self.url)
            )

    def _failed(self, failure: Failure) -> Failure | None:
        if failure.check(CancelledError):
            return failure  # (its client left: nothing said of Redis)
        if not self.fallback:
            self.fallback = True
            self.on_fallback(True)
            log.warn(
                "tenant limits: Redis {url} did not answer ({why}); each process counts its "
                "own requests and tokens per minute until it does",
                url=_shown(self.url),
                why=failure.getErrorMessage() or repr(failure.value),
            )
        return None


def _keys(tenant: str) -> list[str]:
    tag = hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16]
    return [f"nixlproxy:{{{tag}}}:{name}" for name in ("requests", "tokens", "used", "total")]


def _shown(url: str) -> str:
    """The URL without its password, as the log may show it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


def _connect(url: str, connected: Callable[[], None]) -> Any:
    """A txredisapi connection that reconnects on its own (imported only when used)."""
    txredisapi = importlib.import_module("txredisapi")
    parts = urlsplit(url)
    database = parts.path.strip("/")
    redis = txredisapi.lazyConnection(
        host=parts.hostname,
        port=parts.port or 6379,
        dbid=int(database) if database else None,
        password=unquote(parts.password) if parts.password else None,
        username=unquote(parts.username) if parts.username else None,
        ssl_context_factory=parts.scheme == "rediss",
        connectTimeout=1,
    )
    factory = redis._factory
    # Back within a second of Redis, not txredisapi's ten.
    factory.initialDelay, factory.maxDelay = 0.1, 1.0
    added = factory.addConnection

    def addConnection(connection: Any) -> None:
        added(connection)
        if factory.size:
            connected()

    factory.addConnection = addConnection
    return redis
