"""Refusals under load: each counted, and said in the log at most once a second per reason.

A proxy that sheds thousands of requests a second must not write a log line
for each (the access event stays, and ``--access-log off`` drops that too):
the first refusal of a reason is logged at once, the ones within the next
``interval`` are counted, and one line then says how many there were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Counter
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel

from nixl_twisted.protocol.codes import ErrorCode

log = Logger(namespace="nixlproxy.refused")


@dataclass
class _Quiet:
    """One key's line was logged; until ``timer`` fires, more are only counted."""

    timer: IDelayedCall
    held: int = 0
    last: str = ""
    levels: set[LogLevel] = field(default_factory=set)


class LogThrottle:
    """At most one log line per key per ``interval``; the rest summed in one line after it."""

    def __init__(self, clock: IReactorTime, interval: float = 1.0) -> None:
        self.clock = clock
        self.interval = interval
        self._quiet: dict[str, _Quiet] = {}

    def emit(self, key: str, level: LogLevel, message: str) -> None:
        """Log ``message`` now, or count it toward the line said when the interval ends."""
        quiet = self._quiet.get(key)
        if quiet is not None:
            quiet.held += 1
            quiet.last = message
            quiet.levels.add(level)
            return
        log.emit(level, "{said}", said=message, refused=key)
        self._quiet[key] = _Quiet(self.clock.callLater(self.interval, self._said, key))

    def _said(self, key: str) -> None:
        quiet = self._quiet.pop(key)
        if quiet.held:
            level = max(quiet.levels)  # the most severe of those held
            log.emit(
                level,
                "{said} ({count} more like it in the last {interval:g} s)",
                said=quiet.last,
                count=quiet.held,
                interval=self.interval,
                refused=key,
            )
            # Keep summing while they go on: at most one line per interval.
            self._quiet[key] = _Quiet(self.clock.callLater(self.interval, self._said, key))

    def stop(self) -> None:
        """Cancel the pending summaries (the service is stopping)."""
        for quiet in self._quiet.values():
            if quiet.timer.active():
                quiet.timer.cancel()
        self._quiet.clear()


class Refusals:
    """What the proxy refused before serving it: ``nixlproxy_refused_total{reason}`` and the log."""

    def __init__(self, counter: Counter, throttle: LogThrottle) -> None:
        self.counter = counter
        self.throttle = throttle

    def refused(self, reason: ErrorCode, message: str) -> None:
        """One refusal, ``reason`` the error code the client got."""
        self.counter.labels(reason.value).inc()
        self.throttle.emit(reason.value, LogLevel.warn, f"refused ({reason.value}): {message}")
