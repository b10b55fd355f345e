"""One cap per instance for the fleet: the lowest any live replica gives it.

Replicas started with other caps (``--decode-max-in-flight``,
``--prefill-max-in-flight``, ``URL#max-in-flight=N``) would each push their
own into the shared placement. Each replica writes its caps in Redis
(``r:ID:caps``, by ``POOL|URL``; 0 is none), and the fleet holds each
instance to the lowest of the live replicas' (``caps``, which ``PLACE``
reads): a lowered cap holds as soon as one replica has it, a raised one once
every replica has it (a rolling update's last replica). ``CAPS`` writes a
replica's own and reads the fleet's, at each of its heartbeats; a replica
whose cap differs from another's says so (a warning naming the instance and
both caps, ``nixlproxy_replicas_cap_mismatch``, the status page).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from nixl_twisted.fleet.lua_common import COMMON, Caller
from nixl_twisted.fleet.replies import WrongReply, count_of, text
from nixl_twisted.observe.replica_metrics import ReplicaMetrics

log = Logger()

# ARGV: prefix, replica, then pairs of (FIELD, CAP): this replica's caps (0: none), in place
# of those it wrote before. Writes ``caps``: each instance's lowest cap over the live
# replicas (none when none caps it). Returns {FIELD, LOWEST, HIGHEST, ...} over the live
# replicas, 0 for none (as the lowest: no replica caps it; as the highest: one does not).
CAPS = (
    COMMON
    + """
local now = now_ms()
local mine = P .. 'r:' .. me .. ':caps'
redis.call('DEL', mine)
for i = 3, #ARGV - 1, 2 do
  local cap = whole(ARGV[i + 1])
  if cap and lease_field(ARGV[i] .. '|') then redis.call('HSET', mine, ARGV[i], cap) end
end
local lowest, highest, order = {}, {}, {}
for _, r in ipairs(redis.call('ZRANGEBYSCORE', P .. 'alive', now, '+inf')) do
  local flat = safe('HGETALL', P .. 'r:' .. r .. ':caps')
  if flat == nil then
    redis.call('DEL', P .. 'r:' .. r .. ':caps')
    flat = {}
  end
  for i = 1, #flat, 2 do
    local field, cap = flat[i], whole(flat[i + 1])
    if cap then
      local c = cap == 0 and math.huge or cap
      if lowest[field] == nil then
        order[#order + 1] = field
        lowest[field], highest[field] = c, c
      else
        lowest[field] = math.min(lowest[field], c)
        highest[field] = math.max(highest[field], c)
      end
    end
  end
end
redis.call('DEL', P .. 'caps')
local said = {}
local function shown(c) return c == math.huge and 0 or c end
for _, field in ipairs(order) do
  if lowest[field] ~= math.huge then redis.call('HSET', P .. 'caps', field, lowest[field]) end
  said[#said + 1] = field
  said[#said + 1] = shown(lowest[field])
  said[#said + 1] = shown(highest[field])
end
return said
"""
)


@dataclass(frozen=True)
class FleetCap:
    """An instance's caps over the live replicas (0: none)."""

    #: What the fleet holds it to (the lowest), and the highest any replica gives it.
    lowest: int
    highest: int

    @property
    def differs(self) -> bool:
        return self.lowest != self.highest


def share_caps(caller: Caller, mine: Mapping[str, int]) -> Deferred[dict[str, FleetCap]]:
    """Run ``CAPS``: this replica's caps (``POOL|URL`` -> cap) written, the fleet's read."""
    args = [said for where, cap in mine.items() for said in (where, cap)]
    return caller.call(CAPS, args, "caps", read_caps)


def read_caps(reply: object) -> dict[str, FleetCap]:
    """``CAPS``' reply (``WrongReply`` when it is not as the script writes it)."""
    if not isinstance(reply, Sequence) or isinstance(reply, (str, bytes)) or len(reply) % 3:
        raise WrongReply(reply)
    return {
        text(reply[i]): FleetCap(count_of(reply[i + 1]), count_of(reply[i + 2]))
        for i in range(0, len(reply), 3)
    }


def held(own: int, fleet: FleetCap | None) -> int:
    """The cap this replica holds an instance to: the fleet's lowest, or its own until the
    fleet's is known (0: none)."""
    if fleet is None or fleet.lowest == 0:
        return own
    return fleet.lowest if own == 0 else min(own, fleet.lowest)


class CapCheck:
    """Says once per change when this replica's cap of an instance differs from another's."""

    def __init__(self, metrics: ReplicaMetrics) -> None:
        self.metrics = metrics
        #: What was said last of each instance: (its own, the lowest, the highest).
        self._said: dict[str, tuple[int, int, int]] = {}

    def check(self, mine: dict[str, int], fleet: dict[str, FleetCap]) -> None:
        for where, own in mine.items():
            seen = fleet.get(where)
            if seen is None:
                continue
            pool, _, url = where.partition("|")
            labels = {"pool": pool, "instance": url}
            self.metrics.fleet_cap.labels(**labels).set(seen.lowest)
            self.metrics.cap_mismatch.labels(**labels).set(1 if seen.differs else 0)
            now = (own, seen.lowest, seen.highest)
            before = self._said.get(where, (own, own, own))
            self._said[where] = now
            if before == now:
                continue
            if seen.differs:
                other = seen.highest if own == seen.lowest else seen.lowest
                log.warn(
                    "replicas: {pool} instance {url}: this replica's cap is {own}, another "
                    "replica's is {other}; the fleet holds it to {held}, the lowest "
                    '(operations.md, "Replicas")',
                    pool=pool,
                    url=url,
                    own=_cap(own),
                    other=_cap(other),
                    held=_cap(seen.lowest),
                )
            else:
                log.info(
                    "replicas: {pool} instance {url}: every replica's cap is {own} again",
                    pool=pool,
                    url=url,
                    own=_cap(own),
                )
        for where in set(self._said) - set(mine):
            del self._said[where]
            pool, _, url = where.partition("|")
            for gauge in (self.metrics.fleet_cap, self.metrics.cap_mismatch):
                with contextlib.suppress(KeyError):
                    gauge.remove(pool, url)


def _cap(cap: int) -> str:
    return "none" if cap == 0 else str(cap)
