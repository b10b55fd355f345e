"""What discovery says of its sources, for ``/healthcheck`` and ``/metrics`` to read.

``Reported`` is the one interface: each source's state (``Membership.status``)
and the failures counted by pool and kind (``Membership.counted``). The
proxy's own ``Discovery`` offers it; a ``--workers`` worker, which
discovers nothing itself, offers what its supervisor last told it
(``HeardReport``); with no discovery at all, nothing (``NOTHING``).
"""

from __future__ import annotations

from typing import Any, Protocol


class Reported(Protocol):
    """Discovery's sources and their failures, as they are now."""

    def sources(self) -> list[dict[str, Any]]:
        """Each source's state: its pool, kind, name, state, instances, errors, last error."""

    def errors(self) -> list[dict[str, Any]]:
        """The failures since start, by pool and kind (``nixlproxy_discovery_errors_total``)."""


class HeardReport:
    """What another process said of its discovery, as it last said it (a worker's)."""

    def __init__(self) -> None:
        self._sources: list[dict[str, Any]] = []
        self._errors: list[dict[str, Any]] = []

    def told(self, sources: list[dict[str, Any]], errors: list[dict[str, Any]]) -> None:
        self._sources, self._errors = list(sources), list(errors)

    def sources(self) -> list[dict[str, Any]]:
        return self._sources

    def errors(self) -> list[dict[str, Any]]:
        return self._errors


#: No discovery here: no source, no failure.
NOTHING: Reported = HeardReport()
