"""``Roster``: a pool's instances, and the one way each kind of change makes them.

The configuration gives instances (``update``: a reload), the admin API
adds, drains and removes them, and discovery sources list them
(``discovered``). Each instance carries the sources that list it, so that
each of these touches only its own; ``_leave`` is the one way an instance
goes (refused where it would leave no instance in rotation, save where
discovery decides), and a source's last instances are kept (retiring) until
another joins. ``BackendPool`` chooses among what is here.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from twisted.logger import Logger

from nixl_twisted.backends.instances import Instance
from nixl_twisted.config.values import backend_url, cap_of, instance_url, kv_ports, rank_urls

log = Logger()

#: The sources of instances given rather than discovered.
_GIVEN = frozenset({"static", "admin"})
#: What lists an instance no source lists any more, kept as the pool's last.
_RETIRING = frozenset({"retiring"})


class PoolChangeRefused(ValueError):
    """A change that would leave a pool with no instance to send legs to."""


class Roster:
    """The instances of one role and their changes (``BackendPool`` is one)."""

    role: str
    instances: list[Instance]
    #: Discovery may fill it: an update may leave it empty for a while.
    discovers: bool
    #: Instances the admin API drained or removed: discovery does not take them back
    #: while their source still lists them.
    withheld: set[str]
    #: What each discovery source listed last (instance URLs).
    _listed: dict[str, set[str]]

    def _new(self, url: str, source: str) -> Instance:
        raise NotImplementedError

    def _cap(self, instance: Instance, own: int | None) -> None:
        raise NotImplementedError

    @property
    def given(self) -> tuple[str, ...]:
        """The instances given, not discovered: the configuration and the admin API's."""
        return tuple(i.declared for i in self.instances if not i.draining and i.sources & _GIVEN)

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
            instance.kv = kv_ports(name)  # (a reload may move its events, change its cap)
            self._cap(instance, cap_of(name))
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
        else when their last leg ends (``released``). ``refuse=False``: a
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
