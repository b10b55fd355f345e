"""What the discovery sources found, applied to the pools; errors never empty a pool.

A source says either what it lists now (``found``: possibly nothing, which
is authoritative: NXDOMAIN, an empty record set, no Ready pod) or that it
could not tell (``failed``: a timeout, a refused connection, a broken
watch). A failure keeps the last known instances; "nothing" empties the
source only after ``--discovery-grace``, so that a rolling restart of the
DNS server or an API server that briefly answers empty does not take the
pool away. Instances ``--allowed-backends`` refuses are left out, said once.
A pool takes at most ``--discovery-max-instances`` discovered instances: the
first, by source name and then URL, so that the same ones stay as others
come and go; the rest are ignored, said once and shown by each source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.instances import source_kind

log = Logger()

#: --discovery-max-instances' default: discovered instances a pool takes at most.
MAX_INSTANCES = 256

#: (role, source, urls, retire): apply what a source lists now to that pool;
#: ``retire``: the source is no longer configured (its last instances stay until
#: another joins, ``BackendPool.discovered``).
Apply = Callable[[str, str, tuple[str, ...], bool], None]


@dataclass
class SourceState:
    """One source of one pool, as the membership knows it."""

    role: str
    source: str
    #: What it lists now (--allowed-backends applied).
    urls: tuple[str, ...] = ()
    #: What of it the pool has: ``urls`` within --discovery-max-instances.
    applied: tuple[str, ...] = ()
    #: What it last answered, before --allowed-backends (applied again when that changes).
    answered: tuple[str, ...] | None = None
    #: ``starting``, ``ok``, ``failing``, ``emptying`` (grace running) or ``empty``.
    state: str = "starting"
    errors: int = 0
    last_error: str | None = None
    #: URLs --allowed-backends refused, each said once.
    refused: set[str] = field(default_factory=set)
    grace: IDelayedCall | None = None

    def status(self) -> dict[str, Any]:
        return {
            "pool": self.role,
            "source": source_kind(self.source),
            "name": self.source,
            "state": self.state,
            "instances": len(self.applied),
            "ignored": len(self.urls) - len(self.applied),
            "errors": self.errors,
            "last_error": self.last_error,
        }


class Membership:
    """The sources' findings, applied to the pools through ``apply``."""

    def __init__(
        self,
        clock: IReactorTime,
        apply: Apply,
        grace: float = 30.0,
        allowed: AllowedBackends | None = None,
        most: int = MAX_INSTANCES,
        on_status: Callable[[], None] | None = None,
        on_error: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_status``: told of every change of any source's state; ``on_error``: of each
        failure, as (role, kind)."""
        self.clock = clock
        self._apply = apply
        self.grace = grace
        self.allowed = allowed if allowed is not None else AllowedBackends()
        #: --discovery-max-instances: discovered instances a pool takes at most.
        self.most = most
        #: Each pool's discovered instances left out by ``most`` (said when it starts).
        self._ignored: dict[str, int] = {}
        self.sources: dict[tuple[str, str], SourceState] = {}
        #: Failures by pool and kind since start, forgotten sources' included (a counter).
        self.errors: dict[tuple[str, str], int] = {}
        self.on_status = on_status
        self.on_error = on_error

    def add(self, role: str, source: str) -> None:
        self.sources.setdefault((role, source), SourceState(role, source))

    def forget(self, role: str, source: str) -> None:
        """A source no longer configured: its instances drain now."""
        state = self.sources.pop((role, source), None)
        if state is None:
            return
        if state.grace is not None and state.grace.active():
            state.grace.cancel()
        if state.applied:
            self._apply(role, source, (), True)
        changes = self._allot(role)  # (room for what the cap left out)
        self._said()
        self._applied(changes)

    def found(
        self, role: str, source: str, urls: Sequence[str], trouble: str | None = None
    ) -> None:
        """What ``source`` lists now (authoritative: an empty list means none);
        ``trouble``: what failed on the way, though the answer stands (its last error)."""
        state = self.sources.get((role, source))
        if state is None:
            return  # forgotten while it was asking
        before = self.status()
        state.answered = tuple(urls)
        allowed = tuple(sorted(set(self._allowed(state, urls))))
        if state.state == "failing":
            log.info("{role}: {source} answers again", role=role, source=source)
        state.last_error = trouble
        if allowed:
            self._stop_grace(state)
            state.state = "ok"
            state.urls = allowed
            changes = self._allot(role)
            if self.status() != before:
                self._said()  # (first: whoever waits for the change then reads this state)
            self._applied(changes)
            return
        if not state.urls or self.grace <= 0:
            self._empty(state)
            return
        if state.grace is None:
            state.state = "emptying"
            log.warn(
                "{role}: {source} lists no instance; its {count} drain in {grace} s "
                "unless it lists them again",
                role=role,
                source=source,
                count=len(state.applied),
                grace=self.grace,
            )
            state.grace = self.clock.callLater(self.grace, self._empty, state)
        if self.status() != before:
            self._said()

    def failed(self, role: str, source: str, reason: str) -> None:
        """``source`` could not tell: its last known instances stay."""
        state = self.sources.get((role, source))
        if state is None:
            return
        state.errors += 1
        state.last_error = reason
        kind = (role, source_kind(source))
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if self.on_error is not None:
            self.on_error(*kind)
        if state.state != "failing":
            log.warn(
                "{role}: {source} failed, keeping its {count} known instances: {reason}",
                role=role,
                source=source,
                count=len(state.applied),
                reason=reason,
            )
            # (A grace already running goes on: its "none" was the last answer.)
            state.state = "failing"
        self._said()

    def use_allowed(self, allowed: AllowedBackends) -> None:
        """A new --allowed-backends: each source's last answer applied again through it."""
        self.allowed = allowed
        for state in list(self.sources.values()):
            state.refused.clear()
            if state.answered is not None:
                self.found(state.role, state.source, state.answered)

    def use_most(self, most: int) -> None:
        """A new --discovery-max-instances: every pool's sources allotted again."""
        self.most = most
        roles = sorted({state.role for state in self.sources.values()})
        changes = [change for role in roles for change in self._allot(role)]
        if changes:
            self._said()
        self._applied(changes)

    def counted(self) -> list[dict[str, Any]]:
        """The failures by pool and kind, for ``nixlproxy_discovery_errors_total``."""
        return [
            {"pool": role, "source": kind, "errors": count}
            for (role, kind), count in sorted(self.errors.items())
        ]

    def status(self) -> list[dict[str, Any]]:
        """Each source's state: what /healthcheck and the workers are told."""
        return [state.status() for state in self.sources.values()]

    def stop(self) -> None:
        for state in self.sources.values():
            self._stop_grace(state)

    def _empty(self, state: SourceState) -> None:
        """The source lists nothing (and its grace, if any, is over): its instances drain."""
        state.grace = None
        if self.sources.get((state.role, state.source)) is not state:
            return
        before = self.status()
        state.state, state.urls = "empty", ()
        changes = self._allot(state.role)
        if self.status() != before:
            self._said()
        self._applied(changes)

    def _allot(self, role: str) -> list[tuple[SourceState, tuple[str, ...]]]:
        """What each source of ``role`` may have within ``most``: sources by name, each's
        URLs in order, an instance two list counted once; the sources whose share changed."""
        taken: set[str] = set()
        listed: set[str] = set()
        changes = []
        mine = sorted((s for s in self.sources.values() if s.role == role), key=lambda s: s.source)
        for state in mine:
            kept = []
            for url in state.urls:
                if url not in taken and len(taken) < self.most:
                    taken.add(url)
                if url in taken:
                    kept.append(url)
            listed.update(state.urls)
            if tuple(kept) != state.applied:
                state.applied = tuple(kept)
                changes.append((state, state.applied))
        ignored = len(listed) - len(taken)
        was, self._ignored[role] = self._ignored.get(role, 0), ignored
        if ignored and not was:
            log.warn(
                "{role}: discovery lists {count} instances, more than --discovery-max-instances "
                "({most}): the first {most} by source and URL are used, {ignored} ignored",
                role=role,
                count=len(listed),
                most=self.most,
                ignored=ignored,
            )
        elif was and not ignored:
            log.info(
                "{role}: every discovered instance is used again (--discovery-max-instances "
                "{most})",
                role=role,
                most=self.most,
            )
        return changes

    def _applied(self, changes: list[tuple[SourceState, tuple[str, ...]]]) -> None:
        for state, urls in changes:
            self._apply(state.role, state.source, urls, False)

    def _stop_grace(self, state: SourceState) -> None:
        if state.grace is not None:
            if state.grace.active():
                state.grace.cancel()
            state.grace = None

    def _allowed(self, state: SourceState, urls: Sequence[str]) -> list[str]:
        kept = []
        for url in urls:
            refusal = self.allowed.refusal(url)
            if refusal is None:
                kept.append(url)
            elif url not in state.refused:
                state.refused.add(url)
                log.warn(
                    "{role}: {source} lists {url}, left out: {refusal}",
                    role=state.role,
                    source=state.source,
                    url=url,
                    refusal=refusal,
                )
        return kept

    def _said(self) -> None:
        if self.on_status is not None:
            self.on_status()
