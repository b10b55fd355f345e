"""The keys every replica keeps in ``--replicas-redis``, and ``RESTORE``, which writes back
what a replica holds.

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
  wait in all and ``grants`` when the latest were let go (the drain rate),
  ``r:ID:pushed`` its requests pushed out of the full queue, until it hears;
- ``tenants``: each tenant's requests in flight over every replica,
  ``r:ID:tenants`` each replica's (``TENANT|ID``);
- ``caps``: each instance's cap over the fleet, the lowest of the live
  replicas' own (``r:ID:caps``), which ``PLACE`` holds it to (``caps``).

The fleet's queue's scripts are ``queue_scripts``'s; the others are beside
what they serve (``heartbeat``, ``caps``, ``admission``'s ``lease_scripts``).

Every change of ``slots`` is published on ``freed`` (``FIELD\\tCOUNT`` lines, and
a ready lane's count as ``LANE\\tCOUNT``),
so that every replica's view of the fleet follows within a round trip, and a
replica whose request waits first tries again at once.

The counts (``slots``, ``tenants``, ``waiting``) are kept by each script as
it goes, and rebuilt from the live replicas' own records by the heartbeat
(``heartbeat``), which heals whatever else a writer to Redis may have put
there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred

from nixl_twisted.fleet.lua_common import COMMON, Evaluates
from nixl_twisted.fleet.replies import WrongReply, count_of, view_of

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


@dataclass(frozen=True)
class Holdings:
    """What a replica holds, written back by ``RESTORE``: its lease entries
    (``POOL|URL|LEASE``) and its tenants' places (``TENANT|ID``)."""

    leases: list[str]
    tenants: list[str]


def restore(
    link: Evaluates, prefix: str, replica: str, ttl_ms: int, info: str, held: Holdings
) -> Deferred[tuple[dict[str, int], int]]:
    """Run ``RESTORE``: what ``replica`` holds written back; the slots' view and version."""
    args = [prefix, replica, ttl_ms, info, len(held.leases), *held.leases, *held.tenants]
    return link.eval(RESTORE, [], args).addCallback(read_restored)


def read_restored(reply: Any) -> tuple[dict[str, int], int]:
    """``RESTORE``'s reply: the slots' view and its version."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 2:
        raise WrongReply(reply)
    return view_of(reply[0]), count_of(reply[1])
