"""What the discovery sources found, applied to the pools; errors never empty a pool.

A source says either what it lists now (``found``: possibly nothing, which
is authoritative: NXDOMAIN, an empty record set, no Ready pod) or that it
could not tell (``failed``: a timeout, a refused connection, a broken
watch). A failure keeps the last known instances; "nothing" empties the
source only after ``--discovery-grace``, so that a rolling restart of the
DNS server or an API server that briefly answers empty does not take the
pool away. Instances ``--allowed-backends`` refuses are left out, said once.
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

#: (role, source, urls, retire): apply what a source lists now to that pool;
#: ``retire``: the source is no longer configured (its last instances stay until
#: another joins, ``BackendPool.discovered``).
Apply = Callable[[str, str, tuple[str, ...], bool], None]


@dataclass
class SourceState:
    """One source of one pool, as the membership knows it."""

    role: str
    source: str
    #: What it lists now, as applied to the pool.
    urls: tuple[str, ...] = ()
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
            "instances": len(self.urls),
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
    ) -> None:
        self.clock = clock
        self._apply = apply
        self.grace = grace
        self.allowed = allowed if allowed is not None else AllowedBackends()
        self.sources: dict[tuple[str, str], SourceState] = {}
        #: Failures by pool and kind since start, forgotten sources' included (a counter).
        self.errors: dict[tuple[str, str], int] = {}
        #: Told of every change of any source's state (the supervisor tells its workers).
        self.on_status: Callable[[], None] | None = None
        #: Told of each failure: (role, kind), for the errors metric.
        self.on_error: Callable[[str, str], None] | None = None

    def add(self, role: str, source: str) -> None:
        self.sources.setdefault((role, source), SourceState(role, source))

    def forget(self, role: str, source: str) -> None:
        """A source no longer configured: its instances drain now."""
        state = self.sources.pop((role, source), None)
        if state is None:
            return
        if state.grace is not None and state.grace.active():
            state.grace.cancel()
        if state.urls:
            self._apply(role, source, (), True)
        self._said()

    def found(self, role: str, source: str, urls: Sequence[str]) -> None:
        """What ``source`` lists now (authoritative: an empty list means none)."""
        state = self.sources.get((role, source))
        if state is None:
            return  # forgotten while it was asking
        state.answered = tuple(urls)
        allowed = tuple(sorted(set(self._allowed(state, urls))))
        was, had = state.state, state.urls
        if state.state == "failing":
            log.info("{role}: {source} answers again", role=role, source=source)
        state.last_error = None
        if allowed:
            self._stop_grace(state)
            state.state = "ok"
            state.urls = allowed
            if state.state != was or state.urls != had:
                self._said()  # (first: whoever waits for the change then reads this state)
            if allowed != had:
                self._apply(role, source, allowed, False)
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
                count=len(state.urls),
                grace=self.grace,
            )
            state.grace = self.clock.callLater(self.grace, self._empty, state)
        if state.state != was or state.urls != had:
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
                count=len(state.urls),
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
        was, had = state.state, state.urls
        state.state, state.urls = "empty", ()
        if was != "empty" or had:
            self._said()
        if had:
            self._apply(state.role, state.source, (), False)

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
