"""The ``--replicas-redis`` scripts that give a slot back and take or give back a tenant's
place, each called by name (the keys: ``scripts``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred

from nixl_twisted.fleet.lua_common import COMMON, Caller
from nixl_twisted.fleet.replies import WrongReply

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


def release(caller: Caller, leases: Sequence[str]) -> Deferred[Any]:
    """Run ``RELEASE``: the legs of these lease entries (``POOL|URL|LEASE``) ended."""
    return caller.call(RELEASE, list(leases), "release", _as_is)


def tenant_in(caller: Caller, tenant: str, limit: int, place: str) -> Deferred[bool]:
    """Run ``TENANT_IN``: whether ``tenant`` took one more place under ``limit``."""
    return caller.call(TENANT_IN, [tenant, limit, place], "tenant", read_tenant_in)


def tenant_out(caller: Caller, tenant: str, place: str) -> Deferred[Any]:
    """Run ``TENANT_OUT``: that request of ``tenant`` ended."""
    return caller.call(TENANT_OUT, [tenant, place], "tenant", _as_is)


def read_tenant_in(reply: Any) -> bool:
    """``TENANT_IN``'s reply: {1} taken, {0, count} refused."""
    if isinstance(reply, (list, tuple)) and reply and type(reply[0]) is int and reply[0] in (0, 1):
        return bool(reply[0] == 1)
    raise WrongReply(reply)


def _as_is(reply: Any) -> Any:
    return reply
