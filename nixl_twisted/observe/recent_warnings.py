"""``RecentWarnings``: the last warning-or-worse lines of the log, for the status page.

An observer on Twisted's global log publisher keeps the last ``size`` events
at ``warn`` or above, each formatted as the text log writes it (its time, its
system, its message, a failure's traceback), so that the page shows the same
lines an operator would grep for. Events below ``warn`` cost one comparison.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from twisted.application.service import Service
from twisted.logger import (
    ILogObserver,
    LogLevel,
    LogPublisher,
    formatEventAsClassicLogText,
    globalLogPublisher,
)
from zope.interface import implementer

#: Lines kept: enough for an incident's first minutes, small enough to send each second.
SIZE = 50


@implementer(ILogObserver)
class RecentWarnings(Service):
    """The last ``size`` warning-or-worse log lines, observed while the service runs."""

    def __init__(self, size: int = SIZE, publisher: LogPublisher = globalLogPublisher) -> None:
        self._lines: deque[dict[str, Any]] = deque(maxlen=size)
        self._publisher = publisher

    def __call__(self, event: dict[str, Any]) -> None:
        level = event.get("log_level")
        if level is None or level < LogLevel.warn:
            return
        text = formatEventAsClassicLogText(event)
        if text is None:
            return
        self._lines.append(
            {"time": event.get("log_time"), "level": level.name, "line": text.rstrip("\n")}
        )

    def newest_first(self) -> list[dict[str, Any]]:
        """The lines kept, the newest first: ``time`` (seconds since the epoch), ``level``
        (``warn``, ``error``, ``critical``) and ``line`` (as the text log has it)."""
        return list(reversed(self._lines))

    def startService(self) -> None:
        super().startService()
        self._publisher.addObserver(self)

    def stopService(self) -> None:
        super().stopService()
        self._publisher.removeObserver(self)
