"""The backend pools: which prefill and decode instance serves the next leg.

Each pool hands its legs to the instances that are neither down nor
draining, by its policy (``nixl_twisted.backends.routing``; round-robin by
default), and judges what legs and health checks learn of them by
the rules of ``nixl_twisted.backends.health``. Panic: when every instance not
draining is down, legs go to them anyway (best effort) rather than refusing
everything.

A leg holds its instance through a ``Lease`` (``leases``), the one way legs
take and give back an instance. Under ``--workers`` the supervisor owns the instances'
health: a worker's pool reports its outcomes (``report``) and adopts what it
is told.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nixl_twisted.backends import health, outliers
from nixl_twisted.backends.capacity import COOL, Caps, has_room
from nixl_twisted.backends.health import BACKOFF_BASE, DEFAULT_THRESHOLDS, State, Thresholds
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.leases import Lease, NoHealthyInstance, NoRoom
from nixl_twisted.backends.policies import ROUND_ROBIN, Chosen, InUse
from nixl_twisted.backends.prefixes import SentPrefixes
from nixl_twisted.backends.roster import PoolChangeRefused, Roster
from nixl_twisted.backends.routing import NO_ROUTING, Routing
from nixl_twisted.backends.warm_up import joined
from nixl_twisted.config.values import backend_url, cap_of, instance_url, kv_ports, rank_urls
from nixl_twisted.config.words import counted

__all__ = ["BackendPool", "Lease", "NoHealthyInstance", "NoRoom", "PoolChangeRefused"]

log = Logger()

#: (role, url, failure reason or None for a success): an outcome sent elsewhere.
Report = Callable[[str, str, "str | None"], None]


class BackendPool(Roster):
    """Instances of one role, handed out round-robin among those not down.

    How its instances change (given, discovered, drained, removed) is its
    ``Roster``'s part; choosing among them, leases and health are here.
    """

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        clock: IReactorTime,
        thresholds: Thresholds = DEFAULT_THRESHOLDS,
        checked: bool = False,
    ) -> None:
        """``checked``: health checks run, so new instances wait for the first one.

        ``urls``: the instances given (``static``); discovery may add more
        (``discovered``), and a pool that only discovers starts empty.
        """
        self.role = role
        self.clock = clock
        self.thresholds = thresholds
        self._initial = State.PENDING if checked else State.UP
        #: Seconds a joining instance takes the cache policies' misses (``warm_up``).
        self.warm_up = 0.0
        #: How many legs each instance takes at once (``backends.capacity``), and whether
        #: any of its instances has a cap at all (else no leg ever waits for room).
        self.caps = Caps()
        self.capped = False
        #: Some instance answered 503 lately (``cool``): it may be full a moment yet.
        self._cooling = False
        #: Told when a leg ends or an instance stops cooling: room may have come free.
        self._freed: list[Callable[[], object]] = []
        self.instances = [self._new(name, "static") for url in urls for name in rank_urls(url)]
        #: The instances the proxy started with: their first check is no join (no warm-up).
        self._founding = {i.url for i in self.instances}
        self._cursor = 0
        #: Set in a worker: outcomes go to the supervisor, which decides.
        self.report: Report | None = None
        #: Called when an instance's health changed (the supervisor tells its workers).
        self.on_change: Callable[[Instance], None] | None = None
        #: True when the last choice found every instance not draining down (legs go to
        #: them anyway); each model whose instances are so, None for the whole pool.
        self.panicking = False
        self._in_panic: set[str | None] = set()
        #: Which candidate serves the next leg: the pool's policy and each model's own
        #: (``nixl_twisted.backends.policies``).
        self.policies: Chosen = ROUND_ROBIN
        #: The health checks also read each instance's load from vLLM's ``/metrics``.
        self.reads_load = False
        #: Its instances are asked where they publish their KV events.
        self.reads_events = False
        #: cache-aware's memory of which instance was sent which prompt prefix.
        self.sent = SentPrefixes(0)
        #: Discovery may fill it: an update may leave it empty for a while.
        self.discovers = False
        #: Instances the admin API drained or removed: discovery does not take them back
        #: while their source still lists them.
        self.withheld: set[str] = set()
        #: What each discovery source listed last (instance URLs).
        self._listed: dict[str, set[str]] = {}

    def configure(self, thresholds: Thresholds, checked: bool) -> None:
        """New health rules; ``checked``: new instances wait for their first check."""
        self.thresholds = thresholds
        self._initial = State.PENDING if checked else State.UP

    def use_policies(self, chosen: Chosen, warm_up: float = 0.0, load: bool = False) -> None:
        """Choose by ``chosen``, its instances read for what its policies read; ``warm_up``:
        seconds a joining instance takes their misses; ``load``: read whatever (a decide rule)."""
        self.policies = chosen
        self.warm_up = warm_up
        needs = chosen.needs
        self.reads_load = needs.load or load
        self.reads_events = needs.kv_events
        if not self.reads_load:
            for instance in self.instances:
                instance.load = {}  # no longer read: not shown as if it were current

    def _new(self, url: str, source: str) -> Instance:
        declared = backend_url(url)
        instance = Instance(
            instance_url(declared),
            self.role,
            state=self._initial,
            kv=kv_ports(declared),
            sources={source},
            came_from=source,
        )
        self._cap(instance, cap_of(declared))
        if instance.state is State.UP:  # (no health checks: in rotation at once)
            instance.warm_until = self._now() + self.warm_up  # (0 s while the pool is made)
        return instance

    # -- caps ---------------------------------------------------------------

    def use_caps(self, caps: Caps) -> None:
        """Each instance's cap and this process's share of it, from now on."""
        self.caps = caps
        self.capped = False
        for instance in self.instances:
            self._cap(instance, instance.own_cap)
        self.notify_freed()  # (a larger cap: room now)

    def _cap(self, instance: Instance, own: int | None) -> None:
        instance.own_cap = own
        instance.slots = self.caps.slots(instance)
        instance.cap_share = instance.slots
        self.capped = self.capped or instance.slots is not None

    def hold_to(self, instance: Instance, slots: int, cap_share: float) -> bool:
        """``instance`` held to ``slots`` legs of this process, its cap shared with other
        replicas (``admission.shared_slots``): the pool is capped (legs wait for room);
        whether that is more room than it had."""
        roomier = slots > (instance.slots or 0)
        instance.slots = slots
        instance.cap_share = cap_share
        self.capped = True
        return roomier

    def room_for(self, model: str | None) -> bool:
        """Whether some instance that serves ``model`` takes a leg now.

        One with no room stands for every one it would be: the policy decides
        among those with room, and an instance down or draining is the policy's
        to pass over (a pool with none usable answers 503 there, not here).
        """
        now, usable = self._now(), False
        for instance in self.instances:
            if self.available(instance):
                usable = True
                if (model is None or instance.serves(model)) and has_room(instance, now):
                    return True
        return not usable

    def cool(self, instance: Instance) -> None:
        """vLLM answered 503 (its engine's queue is full): it counts as full for a moment."""
        instance.full_until = self._now() + COOL
        self._cooling = True
        self.clock.callLater(COOL, self.notify_freed)

    def on_freed(self, told: Callable[[], object]) -> None:
        """``told()`` whenever room may have come free (a leg ended, a cooling ended)."""
        self._freed.append(told)

    def notify_freed(self) -> None:
        for told in self._freed:
            told()

    @property
    def urls(self) -> tuple[str, ...]:
        """The instances as declared (with their own KV event ports)."""
        return tuple(i.declared for i in self.instances)

    def __len__(self) -> int:
        return len(self.instances)

    def _now(self) -> float:
        return self.clock.seconds()

    def available(self, instance: Instance) -> bool:
        """Not draining, not ejected, and not down (or down but past its backoff: a trial leg)."""
        if instance.draining or self.ejected(instance):
            return False
        return instance.state is not State.DOWN or self._now() >= instance.retry_at

    def ejected(self, instance: Instance) -> bool:
        """Out of rotation a while after failed legs in a row (``outliers``)."""
        return outliers.ejected(instance, self._now())

    def ready(self) -> bool:
        """An instance not draining is up now: what /healthcheck reports."""
        return any(i.healthy and not i.draining for i in self.instances)

    def choose(
        self, exclude: Collection[Instance] = (), routing: Routing = NO_ROUTING, room: bool = False
    ) -> tuple[Instance, str]:
        """The instance for the next leg of this role, and the policy's decision.

        The policy chooses among the available instances; when none is,
        among those not draining (panic, logged once). Raises
        ``NoHealthyInstance`` when every instance was tried or is draining;
        ``room``: only among those under their cap (``NoRoom`` when none is).
        An instance cooling after a 503 is chosen only when every other is.
        """
        model = routing.model
        serving = (
            self.instances if model is None else [i for i in self.instances if i.serves(model)]
        )
        candidates = [i for i in serving if i not in exclude and self.available(i)]
        checked = [i for i in candidates if i.state is not State.PENDING]
        # Checked instances first; only when none is, those still waiting for theirs.
        candidates = checked or candidates
        panic = not candidates
        if panic:
            candidates = [i for i in serving if i not in exclude and not i.draining]
        if not candidates:
            raise NoHealthyInstance(self.role, self.retry_after(), model)
        if room:
            now = self._now()
            candidates = [i for i in candidates if has_room(i, now)]
            if not candidates:
                raise NoRoom(self.role, 1.0, model)
        elif self._cooling:  # (an instance answered 503 lately)
            now = self._now()
            fresh = [i for i in candidates if i.full_until <= now]
            self._cooling = any(i.full_until > now for i in self.instances)
            candidates = fresh or candidates
        # Said once per change, for the pool or for a model's instances in it.
        if panic and model not in self._in_panic:
            self._in_panic.add(model)
            log.warn(
                "{role} pool in panic: every instance{serving} is down, legs go to them anyway",
                role=self.role,
                serving="" if model is None else f" serving {model!r}",
            )
        elif not panic and model in self._in_panic:
            self._in_panic.discard(model)
            log.info(
                "{role} pool out of panic{serving}",
                role=self.role,
                serving="" if model is None else f" (serving {model!r})",
            )
        self.panicking = panic
        instance, decision = self.policy_for(model).policy(self, candidates, routing)
        return instance, decision

    def policy_for(self, model: str | None) -> InUse:
        """The policy that chooses for ``model``: its own (``[models.NAME]``), else the pool's."""
        chosen = self.policies
        if model is None or not chosen.by_model:
            return chosen.default
        return chosen.by_model.get(model, chosen.default)

    def round_robin(self, candidates: Sequence[Instance]) -> Instance:
        """The next of ``candidates`` in the pool's rotation."""
        for _ in range(len(self.instances)):
            instance = self.instances[self._cursor % len(self.instances)]
            # (A pool is never empty: changes that would empty it are refused.)
            self._cursor += 1
            if instance in candidates:
                return instance
        return candidates[0]

    # -- legs in flight ---------------------------------------------------

    def lease(self, instance: Instance, decision: str = "next") -> Lease:
        """Hold ``instance`` for one leg, until the lease is released."""
        instance.in_flight += 1
        return Lease(self, instance, decision)

    def released(self, instance: Instance) -> None:
        """A leg ended; a draining instance with none left leaves the pool."""
        instance.in_flight -= 1
        if instance.draining and instance.in_flight == 0 and instance in self.instances:
            self.instances.remove(instance)
            log.info("{role} instance {url} drained and removed", role=self.role, url=instance.url)
        if self._freed and instance.slots is not None:
            self.notify_freed()

    # -- what legs and health checks learn ---------------------------------

    def record_failure(self, instance: Instance, reason: str, leg: bool = True) -> None:
        """A failed check or leg (``health`` judges both, ``outliers`` a leg)."""
        if leg:
            self.record_error(instance, reason)
        if self.report is not None:
            self.report(self.role, instance.url, reason)
            return
        if health.failed(instance, reason, self.thresholds, self._now()):
            log.warn(
                "{role} instance {url} marked down after {failed} in a row: {reason}",
                role=self.role,
                url=instance.url,
                failures=instance.failures,
                failed=counted(instance.failures, "failure"),
                reason=reason,
            )
            instance.marked_down()
        self._changed(instance)

    def record_success(self, instance: Instance, leg: bool = True) -> None:
        """A check or leg that worked."""
        if leg:
            outliers.succeeded(instance)
        if not health.worth_judging(instance):
            return  # the common case: nothing to learn, nothing to report
        if self.report is not None:
            self.report(self.role, instance.url, None)
            return
        was = instance.state
        if health.succeeded(instance, self.thresholds):
            log.info("{role} instance {url} is back", role=self.role, url=instance.url)
        self._joined(instance, was)
        self._changed(instance)

    def record_error(self, instance: Instance, reason: str) -> None:
        """A failed leg (a 5xx too: up, but failing): toward ejecting it (``outliers``)."""
        rule, now = self.thresholds.outliers, self._now()
        outliers.leg_failed(self.role, self.instances, instance, rule, now, instance.url, reason)

    def _joined(self, instance: Instance, was: State) -> None:
        joined(instance, was, self._founding, self._now() + self.warm_up)

    def load_changed(self, instance: Instance) -> None:
        """A fresh scrape of vLLM's load (the supervisor tells its workers)."""
        self._changed(instance)

    def _changed(self, instance: Instance) -> None:
        if self.on_change is not None:
            self.on_change(instance)

    def adopt(self, verdict: dict[str, Any]) -> None:
        """Take an instance's health as the supervisor decided it (``Instance.health``)."""
        instance = self.find(str(verdict["url"]))
        was = instance.state if instance is not None else State.PENDING
        if instance is not None and health.adopt(instance, verdict):
            self._joined(instance, was)
            log.info(
                "{role} instance {url} is {state} (from the supervisor)",
                role=self.role,
                url=instance.url,
                state=instance.state.value,
            )
            if instance.state is State.DOWN:
                instance.marked_down()

    def retry_after(self) -> float:
        """Seconds until the first down instance may be tried again."""
        now = self._now()
        waits = [max(0.0, i.retry_at - now) for i in self.instances if i.state is State.DOWN]
        return min(waits) if waits else BACKOFF_BASE
