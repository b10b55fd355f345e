"""The backend pools: which prefill and decode instance serves the next leg.

Each pool hands its legs to the instances that are neither down nor
draining, by its policy (``nixl_twisted.backends.routing``; round-robin by
default), and judges what legs and health checks learn of them by
the rules of ``nixl_twisted.backends.health``. Panic: when every instance not
draining is down, legs go to them anyway (best effort) rather than refusing
everything.

A leg holds its instance through a ``Lease``, the one way legs take and give
back an instance. Under ``--workers`` the supervisor owns the instances'
health: a worker's pool reports its outcomes (``report``) and adopts what it
is told.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nixl_twisted.backends import health
from nixl_twisted.backends.health import BACKOFF_BASE, DEFAULT_THRESHOLDS, State, Thresholds
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.prefixes import SentPrefixes
from nixl_twisted.backends.routing import NO_ROUTING, Policy, Routing, round_robin
from nixl_twisted.config.values import backend_url, instance_url, kv_ports, rank_urls

log = Logger()

#: (role, url, failure reason or None for a success): an outcome sent elsewhere.
Report = Callable[[str, str, "str | None"], None]


#: The sources of instances given rather than discovered.
_GIVEN = frozenset({"static", "admin"})
#: What lists an instance no source lists any more, kept as the pool's last.
_RETIRING = frozenset({"retiring"})


class NoHealthyInstance(Exception):
    """Every instance of a pool is draining or was already tried for this leg."""

    def __init__(self, role: str, retry_after: float) -> None:
        super().__init__(f"no healthy {role} instance")
        self.role = role
        self.retry_after = retry_after


class PoolChangeRefused(ValueError):
    """A change that would leave a pool with no instance to send legs to."""


class BackendPool:
    """Instances of one role, handed out round-robin among those not down."""

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
        self.instances = [self._new(name, "static") for url in urls for name in rank_urls(url)]
        self._cursor = 0
        #: Set in a worker: outcomes go to the supervisor, which decides.
        self.report: Report | None = None
        #: Called when an instance's health changed (the supervisor tells its workers).
        self.on_change: Callable[[Instance], None] | None = None
        #: True while every instance not draining is down (legs go to them anyway).
        self.panicking = False
        #: Which candidate serves the next leg (``nixl_twisted.backends.routing``).
        self.policy: Policy = round_robin
        self.policy_name = "round-robin"
        #: The health checks also read each instance's load from vLLM's ``/metrics``.
        self.reads_load = False
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

    def _new(self, url: str, source: str) -> Instance:
        declared = backend_url(url)
        return Instance(
            instance_url(declared),
            self.role,
            state=self._initial,
            kv=kv_ports(declared),
            sources={source},
            came_from=source,
        )

    @property
    def urls(self) -> tuple[str, ...]:
        """The instances as declared (with their own KV event ports)."""
        return tuple(i.declared for i in self.instances)

    @property
    def given(self) -> tuple[str, ...]:
        """The instances given, not discovered: the configuration and the admin API's."""
        return tuple(i.declared for i in self.instances if not i.draining and i.sources & _GIVEN)

    def __len__(self) -> int:
        return len(self.instances)

    def _now(self) -> float:
        return self.clock.seconds()

    def available(self, instance: Instance) -> bool:
        """Not draining, and not down (or down but past its backoff: a trial leg)."""
        if instance.draining:
            return False
        return instance.state is not State.DOWN or self._now() >= instance.retry_at

    def ready(self) -> bool:
        """An instance not draining is up now: what /healthcheck reports."""
        return any(i.healthy and not i.draining for i in self.instances)

    def choose(
        self, exclude: Collection[Instance] = (), routing: Routing = NO_ROUTING
    ) -> tuple[Instance, str]:
        """The instance for the next leg of this role, and the policy's decision.

        The policy chooses among the available instances; when none is,
        among those not draining (panic, logged once). Raises
        ``NoHealthyInstance`` when every instance was tried or is draining.
        """
        candidates = [i for i in self.instances if i not in exclude and self.available(i)]
        checked = [i for i in candidates if i.state is not State.PENDING]
        # Checked instances first; only when none is, those still waiting for theirs.
        candidates = checked or candidates
        panic = not candidates
        if panic:
            candidates = [i for i in self.instances if i not in exclude and not i.draining]
        if not candidates:
            raise NoHealthyInstance(self.role, self.retry_after())
        if panic and not self.panicking:
            log.warn(
                "{role} pool in panic: every instance is down, legs go to them anyway",
                role=self.role,
            )
        elif not panic and self.panicking:
            log.info("{role} pool out of panic", role=self.role)
        self.panicking = panic
        instance, decision = self.policy(self, candidates, routing)
        return instance, decision

    def round_robin(self, candidates: Sequence[Instance]) -> Instance:
        """The next of ``candidates`` in the pool's rotation."""
        for _ in range(len(self.instances)):
            instance = self.instances[self._cursor % len(self.instances)]
            # (A pool is never empty: changes that would empty it are refused.)
            self._cursor += 1
            if instance in candidates:
                return instance
        return candidates[0]

    # -- legs in flight, and live changes ----------------------------------

    def lease(self, instance: Instance, decision: str = "next") -> Lease:
        """Hold ``instance`` for one leg, until the lease is released."""
        instance.in_flight += 1
        return Lease(self, instance, decision)

    def _released(self, instance: Instance) -> None:
        """A leg ended; a draining instance with none left leaves the pool."""
        instance.in_flight -= 1
        if instance.draining and instance.in_flight == 0 and instance in self.instances:
            self.instances.remove(instance)
            log.info("{role} instance {url} drained and removed", role=self.role, url=instance.url)

    def find(self, url: str) -> Instance | None:
        url = instance_url(backend_url(url))
        return next((i for i in self.instances if i.url == url), None)

    def _by_url(self) -> dict[str, Instance]:
        """The instances by URL, made once per change: a lookup per rank stays linear in ranks."""
        return {i.url: i for i in self.instances}

    def find_all(self, url: str) -> list[Instance]:
        """The instances a URL names: itself, or each rank of ``URL#dp=N``."""
        by_url = self._by_url()
        names = [instance_url(name) for name in rank_urls(url)]
        return [by_url[name] for name in names if name in by_url]

    def add(self, url: str, source: str = "admin") -> list[Instance]:
        """Put an instance (each of its ranks) in rotation; a draining one is taken back."""
        names = rank_urls(url)
        self.withheld -= {instance_url(name) for name in names}
        added = self._add(names, source)
        self._end_retirement()
        return added

    def _add(self, names: Sequence[str], source: str, quiet: bool = False) -> list[Instance]:
        """Put these instances (URLs as ``rank_urls`` gives them) in rotation, in order."""
        by_url = self._by_url()
        added = []
        for name in names:
            instance = by_url.get(instance_url(name))
            if instance is None:
                instance = by_url[instance_url(name)] = self._new(name, source)
                self.instances.append(instance)
                if not quiet:
                    log.info("{role} instance {url} added", role=self.role, url=instance.url)
            if instance.sources == _RETIRING:
                instance.sources = set()  # (listed again: no longer retiring)
            instance.kv = kv_ports(name)  # (a reload may move its events)
            instance.sources.add(source)
            instance.draining = False
            added.append(instance)
        return added

    def discovered(
        self, source: str, urls: Sequence[str], retire: bool = False
    ) -> tuple[list[Instance], list[Instance]]:
        """What ``source`` (a DNS name, a selector) lists now: the new join, the vanished drain.

        Only the instances this source listed are touched, and one another
        source (or the configuration) lists too stays. Never refused: the
        discovery decides when a source may empty a pool. An instance the
        admin API drained or removed stays out while the source lists it.
        ``retire``: the source is no longer configured; if its instances
        are the last in rotation they stay until another joins. Returns the
        instances that joined and those that began draining.
        """
        names = [name for url in urls for name in rank_urls(url)]
        listed_now = {instance_url(name) for name in names}
        self.withheld -= self._listed.pop(source, set()) - listed_now
        if listed_now:
            self._listed[source] = listed_now
        names = [name for name in names if instance_url(name) not in self.withheld]
        before = [i for i in self.instances if source in i.sources]
        serving = {i for i in self.instances if not i.draining}
        by_url = self._by_url()
        listed, new = [], []
        for name in names:
            found = by_url.get(instance_url(name))
            if found is not None and source in found.sources:
                listed.append(found)
            else:
                new.append(name)
        kept = set(listed + self._add(new, source, quiet=True))
        joined = [i for i in self.instances if i in kept and i not in serving]
        vanished = [i for i in before if i not in kept]
        leaving = []
        for instance in vanished:
            instance.sources.discard(source)
            if not instance.sources and not instance.draining:
                leaving.append(instance)
        if retire:
            leaving = self._retire(leaving)
        self._leave(leaving, "draining", at_once=False, refuse=False, quiet=True)
        if joined:
            self._end_retirement()
        if joined or leaving:
            changes = [f"+{i.url}" for i in joined] + [f"-{i.url} draining" for i in leaving]
            log.info(
                "{role}: {changes} ({source})",
                role=self.role,
                changes=", ".join(changes),
                source=source,
                joined=[i.url for i in joined],
                leaving=[i.url for i in leaving],
            )
        return joined, leaving

    def _drop(self, leaving: Collection[Instance]) -> None:
        """Take these out of the list in one pass (``list.remove`` each is quadratic)."""
        gone = set(leaving)
        self.instances[:] = [i for i in self.instances if i not in gone]

    def _refuse_emptying(self, leaving: list[Instance]) -> None:
        gone = set(leaving)
        if not any(i not in gone and not i.draining for i in self.instances):
            raise PoolChangeRefused(
                f"{leaving[0].url} is the last {self.role} instance in rotation; "
                "add another before taking it out"
            )

    def drain(self, url: str) -> list[Instance]:
        """No new legs for an instance (each of its ranks); it leaves when its last leg ends."""
        instances = self.find_all(url)
        self._leave(instances, "draining", at_once=False)
        self.withheld |= {i.url for i in instances}  # (discovery may not take it back)
        return instances

    def remove(self, url: str) -> list[Instance]:
        """Take an instance (each of its ranks) out now; legs it serves finish undisturbed."""
        instances = self.find_all(url)
        self._leave(instances, "removed", at_once=True)
        self.withheld |= {i.url for i in instances}
        return instances

    def _retire(self, leaving: list[Instance]) -> list[Instance]:
        """Those that may leave now: all, unless they are the last in rotation.

        The last stay (``retiring``) until another instance joins: a reload
        that swaps a pool's URLs for a name or selector, or renames one, does
        not leave the pool empty while the new source has not answered yet.
        """
        gone = set(leaving)
        if not leaving or any(
            i not in gone and not i.draining and i.sources != _RETIRING for i in self.instances
        ):
            return leaving
        for instance in leaving:
            instance.sources = set(_RETIRING)
            log.warn(
                "{role} instance {url} kept until another joins: it is the last in rotation",
                role=self.role,
                url=instance.url,
            )
        return []

    def _end_retirement(self) -> None:
        """Another instance is in rotation: the retiring ones drain now."""
        retiring = [i for i in self.instances if i.sources == _RETIRING and not i.draining]
        if retiring and any(not i.draining and i.sources != _RETIRING for i in self.instances):
            for instance in retiring:
                instance.sources = set()
            self._leave(retiring, "draining", at_once=False, refuse=False)

    def update(self, urls: Sequence[str]) -> None:
        """Make the given instances these URLs (a reload): add the new, drain the unlisted.

        Instances the admin API added count as given: a reload drains them
        too. Discovered ones stay while their source lists them.
        """
        if not urls and not self.discovers:
            raise PoolChangeRefused(f"the {self.role} pool needs at least one instance")
        names = [name for url in urls for name in rank_urls(url)]
        self.withheld -= {instance_url(name) for name in names}
        kept = set(self._add(names, "static"))
        leaving = []
        for instance in self.instances:
            if instance not in kept:
                instance.sources -= _GIVEN
                if not instance.sources:
                    leaving.append(instance)
        if self.discovers:  # (a discovered pool may be empty now: it keeps its last instead)
            leaving = self._retire(leaving)
        self._leave(leaving, "draining", at_once=False, refuse=not self.discovers)
        self._end_retirement()

    def _leave(
        self,
        leaving: list[Instance],
        said: str,
        at_once: bool,
        refuse: bool = True,
        quiet: bool = False,
    ) -> None:
        """The one way instances leave; refused if it would leave no instance in rotation.

        No new legs from now; out of the list at once if ``at_once`` or idle,
        else when their last leg ends (``_released``). ``refuse=False``: a
        discovery's change, which may empty the pool.
        """
        if not leaving:
            return
        if refuse:
            self._refuse_emptying(leaving)
        for instance in leaving:
            if not quiet and (at_once or not instance.draining):  # (a reload: said once)
                log.info(
                    "{role} instance {url} {said}", role=self.role, url=instance.url, said=said
                )
            instance.draining = True
        self._drop([i for i in leaving if at_once or i.in_flight == 0])

    # -- what legs and health checks learn ---------------------------------

    def record_failure(self, instance: Instance, reason: str) -> None:
        """A failed check or leg (``nixl_twisted.backends.health`` says what it makes of it)."""
        if self.report is not None:
            self.report(self.role, instance.url, reason)
            return
        if health.failed(instance, reason, self.thresholds, self._now()):
            log.warn(
                "{role} instance {url} marked down after {failures} failures in a row: {reason}",
                role=self.role,
                url=instance.url,
                failures=instance.failures,
                reason=reason,
            )
        self._changed(instance)

    def record_success(self, instance: Instance) -> None:
        """A check or leg that worked."""
        if not health.worth_judging(instance):
            return  # the common case: nothing to learn, nothing to report
        if self.report is not None:
            self.report(self.role, instance.url, None)
            return
        if health.succeeded(instance, self.thresholds):
            log.info("{role} instance {url} is back", role=self.role, url=instance.url)
        self._changed(instance)

    def load_changed(self, instance: Instance) -> None:
        """A fresh scrape of vLLM's load (the supervisor tells its workers)."""
        self._changed(instance)

    def _changed(self, instance: Instance) -> None:
        if self.on_change is not None:
            self.on_change(instance)

    def adopt(self, verdict: dict[str, Any]) -> None:
        """Take an instance's health as the supervisor decided it (``Instance.health``)."""
        instance = self.find(str(verdict["url"]))
        if instance is not None and health.adopt(instance, verdict):
            log.info(
                "{role} instance {url} is {state} (from the supervisor)",
                role=self.role,
                url=instance.url,
                state=instance.state.value,
            )

    def retry_after(self) -> float:
        """Seconds until the first down instance may be tried again."""
        now = self._now()
        waits = [max(0.0, i.retry_at - now) for i in self.instances if i.state is State.DOWN]
        return min(waits) if waits else BACKOFF_BASE


class Lease:
    """One leg's hold on an instance; released exactly once, however the leg ends."""

    def __init__(self, pool: BackendPool, instance: Instance, decision: str = "next") -> None:
        self.pool = pool
        self.instance = instance
        #: Why the pool's policy chose this instance.
        self.decision = decision
        self.held = True
        #: What else ends with the leg (its trace span).
        self.on_release: Callable[[], object] | None = None

    def release(self, result: object = None) -> object:
        """Give the instance back (usable as a callback: passes ``result`` on)."""
        if self.held:
            self.held = False
            self.pool._released(self.instance)
            if self.on_release is not None:
                self.on_release()
        return result
