"""A replica's sign-out as it stops (``SIGN_OUT``): what it still holds given back at once.

A replica that stops beating is forgotten by the others' heartbeats only once its own
has lapsed (``TTL`` s), and counted among the live meanwhile (the static shares are the
cap over them). One that stops cleanly (SIGTERM, once drained) says so instead: its
slots, queue entries and tenants' places are given back, and its liveness gone, at once,
by the heartbeat's own ``forget``.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.fleet.link import RedisLink
from nixl_twisted.fleet.lua_common import COMMON
from nixl_twisted.fleet.replies import count_of, shown, why

log = Logger()

# ARGV: prefix, replica. Returns the leases given back.
SIGN_OUT = COMMON + "\nreturn forget(me, false)\n"


def sign_out(
    link: RedisLink, prefix: str, replica: str, reactor: Any, budget: float, ttl: float
) -> Deferred[None]:
    """Sign ``replica`` out through ``link`` within ``budget`` s; said either way, never
    failed (the others forget it within ``ttl`` s when Redis does not answer now)."""
    sent = link.eval(SIGN_OUT, [], [prefix, replica])
    sent.addTimeout(budget, reactor)

    def signed(reply: object) -> None:
        log.info(
            "replicas: replica {id} signed out of Redis {url} ({given} slots given back)",
            id=replica,
            url=shown(link.url),
            given=count_of(reply),
        )

    def failed(failure: Failure) -> None:
        log.info(
            "replicas: replica {id} could not sign out of Redis {url} ({why}); the others "
            "forget it within {ttl:g} s",
            id=replica,
            url=shown(link.url),
            why=why(failure, budget, link.open)[1],
            ttl=ttl,
        )

    return sent.addCallbacks(signed, failed)
