"""``FleetAdmin``: the admin API's changes (add, drain, remove) made on every replica.

A change made through one replica's admin API is written to Redis (the
hash ``admin``: each instance's latest change, by ``POOL|URL``) and
published on the channel of the same name, so that every replica makes it
within a round trip; each heartbeat also reads the hash, so that a replica
that missed a message (its subscription down) or starts later makes the
fleet's changes too. The fleet's latest change of an instance wins over a
replica's ``--prefill``/``--decode`` list, at start and after a SIGHUP
(which reads the hash again): to take an instance back, add it through
the admin API.

Each change is one line, ``v1 SEQ OP POOL URL REPLICA`` (tab-separated;
``SEQ`` numbers the fleet's changes, so that an older one never undoes a
newer). Redis is inside the trust boundary, but what is read from it is
checked: a line that does not parse is ignored and counted, an instance
added is held to this replica's ``--allowed-backends``, and the hash holds
at most ``ADMIN_MAX`` instances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.pools import PoolChangeRefused
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.values import InvalidValue, backend_url
from nixl_twisted.fleet.channel import Channel
from nixl_twisted.fleet.lua_common import COMMON
from nixl_twisted.fleet.replicas import Replicas, Unshared
from nixl_twisted.fleet.replies import WrongReply, text
from nixl_twisted.happened import Happened
from nixl_twisted.observe.replica_metrics import ReplicaMetrics

log = Logger()

VERSION = "v1"
OPS = frozenset({"add", "drain", "remove"})
POOLS = frozenset({"prefill", "decode"})
#: The most instances the fleet's changes name, and the longest line read.
ADMIN_MAX = 1024
LINE_MAX = 4096

# ARGV: prefix, replica, op, pool, url. The change written as the instance's latest and
# published; returns its line ('' when the hash names ``ADMIN_MAX`` other instances).
TELL = (
    COMMON
    + f"""
local MAX = {ADMIN_MAX}
"""
    + """
local key = P .. 'admin'
local kind = redis.call('TYPE', key)['ok']
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', key) end
local field = ARGV[4] .. '|' .. ARGV[5]
if redis.call('HEXISTS', key, field) == 0 and redis.call('HLEN', key) >= MAX then return '' end
local seq = bump(P .. 'admin-seq', 1)
local line = table.concat({'v1', seq, ARGV[3], ARGV[4], ARGV[5], me}, '\\t')
redis.call('HSET', key, field, line)
redis.call('PUBLISH', key, line)
return line
"""
)

# ARGV: prefix, replica. The fleet's changes, each instance's latest (a key of another
# type deleted; at most ``ADMIN_MAX`` lines, none longer than ``LINE_MAX``).
READ = (
    COMMON
    + f"""
local MAX, LONGEST = {ADMIN_MAX}, {LINE_MAX}
"""
    + """
local key = P .. 'admin'
local flat = safe('HGETALL', key)
if flat == nil then
  redis.call('DEL', key)
  return {}
end
local lines = {}
for i = 2, math.min(#flat, 2 * MAX), 2 do
  if #flat[i] <= LONGEST then lines[#lines + 1] = flat[i] end
end
return lines
"""
)


@dataclass(frozen=True)
class Change:
    """One admin change of the fleet's, as read."""

    seq: int
    op: str
    pool: str
    url: str
    replica: str

    @property
    def instance(self) -> str:
        return f"{self.pool}|{self.url}"


def read_change(line: str) -> Change | None:
    """A change's line, checked (None: it does not parse)."""
    parts = line.split("\t")
    if len(line) > LINE_MAX or len(parts) != 6 or parts[0] != VERSION:
        return None
    _, seq, op, pool, url, replica = parts
    if not (seq.isascii() and seq.isdigit()) or op not in OPS or pool not in POOLS:
        return None
    if not replica or not replica.isascii() or not replica.isalnum():
        return None
    try:
        if backend_url(url) != url:
            return None
    except InvalidValue:
        return None
    return Change(int(seq), op, pool, url, replica)


def _lines(reply: Any) -> list[str]:
    if not isinstance(reply, (list, tuple)):
        raise WrongReply(reply)
    return [text(line) for line in reply]


class FleetAdmin(Service):
    """This replica's admin changes told to the fleet, and the fleet's made here."""

    name = "fleet-admin"

    def __init__(
        self,
        replicas: Replicas,
        backends: BackendService,
        config: ProxyConfig,
        metrics: ReplicaMetrics,
    ) -> None:
        self.replicas = replicas
        self.backends = backends
        self.metrics = metrics
        self.channel = Channel(
            replicas.reactor, replicas.url, replicas.prefix + "admin", self._heard
        )
        #: The latest change made here of each instance (``POOL|URL`` -> its ``SEQ``).
        self._seen: dict[str, int] = {}
        #: The next read makes this replica's own changes too (after a reload).
        self._own_too = False
        self._made = Happened()
        self.configure(config)
        replicas.hold(self)

    def configure(self, config: ProxyConfig) -> None:
        """``--allowed-backends`` from now on; the pools were made again from the file, so the
        fleet's changes are made again at the next heartbeat (they win over the file)."""
        self.allowed = AllowedBackends(config.discovery.allowed)
        self._seen.clear()
        self._own_too = True

    def startService(self) -> None:
        super().startService()
        self.channel.start()

    def stopService(self) -> Any:
        super().stopService()
        return self.channel.stop()

    def made(self) -> Deferred[None]:
        """Fires once the next change another replica told is made here (for tests)."""
        return self._made.wait()

    # -- told -----------------------------------------------------------------------

    def tell(self, change: dict[str, str]) -> Deferred[None]:
        """The fleet is told of a change made here (``{"op", "pool", "url"}``); never fails:
        when Redis does not take it, the change is this replica's alone, said in the log."""
        if not self.replicas.running:
            return succeed(None)
        op, pool, url = change["op"], change["pool"], change["url"]

        def written(line: str) -> None:
            told = read_change(line)
            if told is None:
                log.warn(
                    "replicas: the admin change ({op} {pool} instance {url}) was made on this "
                    "replica only: the fleet's changes already name {most} instances",
                    op=op,
                    pool=pool,
                    url=url,
                    most=ADMIN_MAX,
                )
                return
            self._seen[told.instance] = max(told.seq, self._seen.get(told.instance, 0))
            self.metrics.admin_changes.labels(outcome="told").inc()

        def unshared(failure: Failure) -> None:
            failure.trap(Unshared)
            log.warn(
                "replicas: the admin change ({op} {pool} instance {url}) was made on this "
                "replica only: Redis is not answering; make it again once it answers",
                op=op,
                pool=pool,
                url=url,
            )

        sent = self.replicas.call(TELL, [op, pool, url], "admin", text)
        return sent.addCallbacks(written, unshared)

    # -- heard ----------------------------------------------------------------------

    def held(self) -> tuple[list[str], list[str]]:
        return [], []

    def shared(self, view: dict[str, int], version: int) -> None:
        """Each heartbeat: the fleet's changes read, those not made here yet made."""
        own_too, self._own_too = self._own_too, False

        def read(lines: list[str]) -> None:
            for line in lines:
                self._take(line, own_too)

        def unshared(failure: Failure) -> None:
            failure.trap(Unshared)
            self._own_too = self._own_too or own_too

        self.replicas.call(READ, [], "admin_read", _lines).addCallbacks(read, unshared)

    def alone(self) -> None:
        pass

    def restored(self) -> None:
        pass

    def _heard(self, message: str) -> None:
        self._take(message, own_too=False)

    def _take(self, line: str, own_too: bool) -> None:
        change = read_change(line)
        if change is None:
            self.metrics.admin_changes.labels(outcome="malformed").inc()
            return
        if self._seen.get(change.instance, -1) >= change.seq:
            return
        self._seen[change.instance] = change.seq
        if change.replica == self.replicas.id and not own_too:
            return  # (made here as it was asked)
        self.metrics.admin_changes.labels(outcome=self._make(change)).inc()
        made, self._made = self._made, Happened()
        made.fire()

    def _make(self, change: Change) -> str:
        """The change made on this replica; its outcome's name."""
        said = {"op": change.op, "pool": change.pool, "url": change.url}
        if change.op == "add":
            refusal = self.allowed.refusal(change.url)
            if refusal is not None:
                log.warn(
                    "replicas: replica {replica} added {pool} instance {url}; not here: {why}",
                    replica=change.replica,
                    pool=change.pool,
                    url=change.url,
                    why=refusal,
                )
                return "not_allowed"
        try:
            instances = self.backends.apply_change(said)
        except PoolChangeRefused as error:
            log.warn(
                "replicas: {op} of {pool} instance {url} (replica {replica}'s admin API) "
                "refused here: {why}",
                why=str(error),
                replica=change.replica,
                **said,
            )
            return "refused"
        if not instances:
            return "unknown"
        log.info(
            "replicas: {op} of {pool} instance {url}, as replica {replica}'s admin API was told",
            replica=change.replica,
            **said,
        )
        return "applied"
