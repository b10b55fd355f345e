"""``Replicas``: this process as one replica of the proxy, in ``--replicas-redis``.

It beats once a second (``heartbeat``): its heartbeat expires ``TTL`` later,
and the heartbeat of any replica forgets every replica whose own expired,
with everything it held (slots, waiting requests, tenants' requests in
flight), so that a replica that dies (SIGKILL, a lost node) gives its slots
back within ``TTL`` plus a beat. Each beat also reads who is alive and the
fleet's slots (the view the routing policies and the queue look at).

Redis never fails a request: a script not answered within ``BUDGET`` s, an
error, a refused or lost connection puts the replica *alone* (said once in
the log, ``nixlproxy_replicas_fallback`` 1): each part then does what it
does without Redis (the caps at their static share, the queue of this
process). At the next beat that answers, the replica writes back what it
holds now in place of whatever Redis kept of it (``RESTORE``: no slot lost
or counted twice) and is *shared* again.

What Redis records a live replica holds (its requests waiting, its leases,
its tenants' places) every script trusts, and only that replica knows it
true: at each shared beat its holders are told the records (``on_records``)
and give back each one they do not hold, once every call of theirs that may
have added one has been answered (``Unanswered``).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, overload

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.config.words import counted
from nixl_twisted.fleet.channel import Channel
from nixl_twisted.fleet.first_contact import FirstContact
from nixl_twisted.fleet.heartbeat import Beat, Own, heartbeat
from nixl_twisted.fleet.link import RETRY, RedisLink
from nixl_twisted.fleet.replies import (
    freed,
    prefix_of,
    pushed,
    shown,
    why,
)
from nixl_twisted.fleet.scripts import Holdings, restore
from nixl_twisted.fleet.sign_out import sign_out
from nixl_twisted.happened import Happened
from nixl_twisted.observe.replica_metrics import ReplicaMetrics

log = Logger()

T = TypeVar("T")

#: Seconds between two heartbeats, and how long one lasts: a replica that stops beating
#: is forgotten, and its slots given back, within ``TTL + BEAT`` seconds.
BEAT = 1.0
TTL = 3.0
#: Seconds a script may take before this replica goes on alone.
BUDGET = 0.1
#: A heartbeat is given longer: it reads the whole view.
BEAT_BUDGET = 1.0


class Holder(Protocol):
    """What this replica holds in Redis, written back whole when it is shared again."""

    def held(self) -> tuple[list[str], list[str]]:
        """Its lease entries (``POOL|URL|LEASE``) and tenants' entries (``TENANT|ID``)."""

    def shared(self, view: dict[str, int], version: int) -> None:
        """Redis answers: this is the fleet's view of the slots (``POOL|URL`` -> legs), as
        of ``version`` (each change of the slots counts one)."""

    def alone(self) -> None:
        """Redis does not answer: each part goes on without it."""

    def restored(self) -> None:
        """What this replica holds was written back whole: anything else of it in Redis is
        gone (its waiting requests, for one)."""


class Unanswered:
    """A holder's calls to Redis whose answers it has not taken in yet: what Redis records of
    this replica may be ahead of what the holder holds until they are."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._open: set[int] = set()
        self._after: list[tuple[set[int], Callable[[], object]]] = []

    def sent(self) -> int:
        """One more call sent: its id, for ``answered`` once its answer is taken in."""
        call = next(self._ids)
        self._open.add(call)
        return call

    def answered(self, call: int) -> None:
        self._open.discard(call)
        if not self._after:
            return
        waiting, self._after = self._after, []
        for calls, then in waiting:
            calls.discard(call)
            if calls:
                self._after.append((calls, then))
            else:
                then()

    def after(self, then: Callable[[], object]) -> None:
        """``then()`` once every call unanswered now has been answered (at once if none)."""
        if not self._open:
            then()
        else:
            self._after.append((set(self._open), then))


class Unshared(Exception):
    """Redis is not answering now: the caller goes on alone, at once."""


class Replicas(Service):
    """This replica's heartbeat, its calls to Redis, and whether they answer."""

    name = "replicas"

    def __init__(
        self,
        url: str,
        reactor: Any,
        clock: IReactorTime,
        metrics: ReplicaMetrics,
        worker: int | None = None,
    ) -> None:
        """``clock``: the proxy's (the beat); ``reactor``: the network and each call's
        budget."""
        self.url = url
        self.reactor = reactor
        self.clock = clock
        self.metrics = metrics
        self.id = uuid.uuid4().hex[:12]
        self.prefix = prefix_of(url)
        self.info = json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "worker": worker,
                "started": round(time.time()),
            },
            separators=(",", ":"),
        )
        self.link = RedisLink(url, clock, self._refused, reactor)
        self.channel = Channel(reactor, url, self.prefix + "freed", self._heard)
        #: The fleet's state is shared now (else each part goes on alone).
        self.is_shared = False
        #: The live replicas, by id: what each says of itself.
        self.seen: dict[str, dict[str, Any]] = {}
        self._holders: list[Holder] = []
        self._freed: list[Callable[[dict[str, int], int | None], object]] = []
        self._records: list[Callable[[Own], object]] = []
        self._pushed: list[Callable[[str], object]] = []
        self._beat: LoopingCall | None = None
        self._beating: set[Deferred[Any]] = set()
        self._stopped = False
        self._away_said = False
        #: Whether Redis has answered once since the start (else: not ready, no capped slot).
        self.first = FirstContact(url)
        self._ready = Happened()
        self._said_shared = False
        #: Seconds each heartbeat lasts (``TTL``).
        self.ttl = TTL

    # -- who listens ----------------------------------------------------------------

    def hold(self, holder: Holder) -> None:
        """``holder`` keeps state in Redis: written back at each return, told each change."""
        self._holders.append(holder)

    def on_freed(self, told: Callable[[dict[str, int], int | None], object]) -> None:
        """``told(changed, version)`` on each message of the fleet's: slots that changed
        (``POOL|URL`` -> legs) as of ``version``, or none (None: a request may go now)."""
        self._freed.append(told)

    def on_pushed(self, told: Callable[[str], object]) -> None:
        """``told(member)`` when a message says a waiting request was pushed out of the
        fleet's full queue (any replica's: ``told`` knows its own)."""
        self._pushed.append(told)

    def on_records(self, told: Callable[[Own], object]) -> None:
        """``told(own)`` at each heartbeat while shared: what Redis records this replica
        holds, for ``told`` to give back what it does not."""
        self._records.append(told)

    def ready(self) -> Deferred[None]:
        """Fires once the fleet's state is shared (at once if it is now): for tests and
        operators."""
        if self.is_shared:
            return succeed(None)
        return self._ready.wait()

    def status(self) -> dict[str, Any]:
        """What ``/healthcheck`` and the status page say of the fleet's replicas."""
        return {
            "redis": shown(self.url),
            "shared": self.is_shared,
            "reached": self.first.reached,
            "problem": self.first.problem,
            "id": self.id,
            "seen": [
                {"id": replica, **{k: info.get(k) for k in ("host", "pid", "worker", "started")}}
                for replica, info in sorted(self.seen.items())
            ],
        }

    @property
    def count(self) -> int:
        """Replicas alive as last read (this one at least): the static share's divisor."""
        return max(1, len(self.seen))

    # -- the service ---------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.link.start()
        self.channel.start()
        self._beat = LoopingCall(self.beat)
        self._beat.clock = self.clock
        self._beat.start(BEAT, now=True)

    def stopService(self) -> Deferred[None]:
        """Sign out (what this replica holds given back at once), then close the link."""
        if not self.running:
            return succeed(None)
        super().stopService()
        self._stopped = True  # (from now on a call that fails is no news: ``away``)
        was_shared, self.is_shared = self.is_shared, False
        if was_shared:  # (each part goes on alone: its calls would fail from now on)
            for holder in self._holders:
                holder.alone()
        if self._beat is not None and self._beat.running:
            self._beat.stop()
        self.channel.stop()  # (its closing is not waited for: it holds nothing)
        for beating in list(self._beating):  # (one waiting for a connection would wait on)
            beating.cancel()
        signed = succeed(None)
        if self.link.open:
            signed = sign_out(self.link, self.prefix, self.id, self.reactor, BEAT_BUDGET, self.ttl)
        return signed.addBoth(lambda _: self.link.stop())

    # -- calls ------------------------------------------------------------------------

    @overload
    def call(self, script: str, args: Sequence[object], name: str) -> Deferred[Any]: ...

    @overload
    def call(
        self,
        script: str,
        args: Sequence[object],
        name: str,
        read: Callable[[Any], T],
        budget: float = BUDGET,
    ) -> Deferred[T]: ...

    def call(
        self,
        script: str,
        args: Sequence[object],
        name: str,
        read: Callable[[Any], Any] = lambda reply: reply,
        budget: float = BUDGET,
    ) -> Deferred[Any]:
        """Run ``script`` with this replica's prefix and id first, its reply read by ``read``;
        fails with ``Unshared`` at once until a beat has shared this replica's state (Redis
        away, or back but without this replica's leases yet: a slot granted then would be
        counted without them), or when it does not answer within ``budget``, or answers what
        ``read`` cannot read (``WrongReply``, or any error of its: never the caller's)."""
        if not self.is_shared:
            return fail(
                Unshared("Redis is not answering" if not self.link.open else "not shared yet")
            )
        started = self.reactor.seconds()
        sent = self.link.eval(script, [], [self.prefix, self.id, *args])
        sent.addTimeout(budget, self.reactor)

        def answered(result: object) -> Any:
            self.metrics.redis_seconds.labels(script=name).observe(self.reactor.seconds() - started)
            return read(result)

        def failed(failure: Failure) -> Failure:
            if failure.check(defer.CancelledError) and not failure.check(defer.TimeoutError):
                return failure
            self.away(why(failure, budget, self.link.open))
            return Failure(Unshared(failure.getErrorMessage()))

        return sent.addCallback(answered).addErrback(failed)

    def beat(self) -> Deferred[None]:
        """One heartbeat: alive for ``TTL`` more, the dead forgotten, the view read; written
        back whole when Redis had forgotten this replica or was away."""
        ttl_ms = int(self.ttl * 1000)
        sent = heartbeat(self.link, self.prefix, self.id, ttl_ms, self.info, int(TTL * 1000))
        sent.addTimeout(BEAT_BUDGET, self.reactor)
        self._beating.add(sent)
        sent.addBoth(_passed, lambda: self._beating.discard(sent))

        def beaten(beat: Beat) -> Deferred[None]:
            if self._stopped:
                return succeed(None)  # (signed out since: nothing to write back)
            # (each beat, not only this replica's own placements: idle, it places none)
            self.metrics.fleet_waiting.set(beat.waiting)
            if beat.purged:
                self.metrics.leases_expired.inc(beat.purged)
            for replica in beat.dead:
                log.info(
                    "replicas: replica {replica} stopped beating; what it held is given back "
                    "({slots} in all)",
                    replica=replica,
                    purged=beat.purged,
                    slots=counted(beat.purged, "slot"),
                )
            self.seen = beat.live
            self.metrics.seen.set(len(self.seen))
            if beat.mine and self.is_shared:
                self._shared(beat.view, beat.version)
                for told in self._records:
                    told(beat.own)
                return succeed(None)
            return self._restore()

        def failed(failure: Failure) -> None:
            self.away(why(failure, BEAT_BUDGET, self.link.open))

        return sent.addCallback(beaten).addErrback(failed)

    def _restore(self) -> Deferred[None]:
        held = Holdings([], [])
        for holder in self._holders:
            leases, tenants = holder.held()
            held.leases.extend(leases)
            held.tenants.extend(tenants)
        sent = restore(self.link, self.prefix, self.id, int(self.ttl * 1000), self.info, held)
        sent.addTimeout(BEAT_BUDGET, self.reactor)

        def restored(said: tuple[dict[str, int], int]) -> None:
            view, version = said
            was = self._away_said
            self.is_shared = True
            self.first.made()
            self._away_said = False
            self.metrics.fallback.set(0)
            for holder in self._holders:
                holder.restored()
            if was or not self._said_shared:
                self._said_shared = True
                log.info(
                    "replicas: replica {id} shares caps, queue and tenants with {replicas} "
                    "through Redis {url}{again}",
                    id=self.id,
                    count=self.count,
                    replicas=counted(self.count, "replica"),
                    url=shown(self.url),
                    again=" (it answers again)" if was else "",
                )
            self._shared(view, version)
            ready, self._ready = self._ready, Happened()
            ready.fire()

        def failed(failure: Failure) -> None:
            self.away(why(failure, BEAT_BUDGET, self.link.open))

        return sent.addCallback(restored).addErrback(failed)

    def _shared(self, view: dict[str, int], version: int) -> None:
        for holder in self._holders:
            holder.shared(view, version)

    def away(self, what: tuple[str, str]) -> None:
        """Redis did not answer: every part goes on alone until a beat answers again (a call
        cut short by this replica's own stop is no news)."""
        if self._stopped:
            return
        reason, said = what
        if reason == "not_connected" and self.link.unreachable is not None:
            said = f"could not be reached: {self.link.unreachable}"
        if not self.first.reached:
            self.metrics.fallback.set(1)
            self.first.failed(said)
            return
        if self.is_shared or not self._away_said:
            self.metrics.fallbacks.labels(reason=reason).inc()
        was_shared, self.is_shared = self.is_shared, False
        self.metrics.fallback.set(1)
        if not self._away_said:
            self._away_said = True
            log.warn(
                "replicas: Redis {url} {what}; this replica holds each cap to its share "
                "(cap / {replicas}) and queues alone until it answers again",
                url=shown(self.url),
                what=said,
                count=self.count,
                replicas=counted(self.count, "replica"),
            )
        if was_shared:
            for holder in self._holders:
                holder.alone()

    def _refused(self, why: str) -> None:
        self.away(("refused", f"refused the connection ({why}; tried again every {RETRY:g} s)"))

    def _heard(self, message: str) -> None:
        member = pushed(message)
        if member is not None:
            for heard in self._pushed:
                heard(member)
            return
        changed, version = freed(message)
        for told in self._freed:
            told(changed, version)


def _passed(result: T, then: Callable[[], object]) -> T:
    """A callback that runs ``then`` and passes ``result`` on."""
    then()
    return result
