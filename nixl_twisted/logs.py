"""Log observers: text for people, flat JSON lines for log pipelines, both filtered by level.

twistd asks its application for an ``ILogObserver`` before it logs; the
proxy offers one (``offer``) when the defaults are not enough: JSON, a
``--log-level`` other than ``info``, or a ``--workers`` worker, whose every
line carries its index. ``json_lines`` is the same JSON observer as an
``ILogObserver`` factory for ``twistd --logger=nixl_twisted.logs.json_lines``.

A JSON line is one flat object (documented in ``docs/operations.md``):
``time`` (RFC 3339, UTC), ``level``, ``logger``, ``message`` (rendered),
``worker`` in a worker, ``error`` for a failure, then the event's own
scalar fields; an access event's fields are top-level keys.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from functools import lru_cache
from typing import IO, Any, cast

from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogFilterPredicate,
    ILogObserver,
    Logger,
    LogLevel,
    PredicateResult,
    formatEvent,
    formatEventAsClassicLogText,
    formatTime,
    timeFormatRFC3339,
)
from twisted.python.logfile import LogFile
from zope.interface import implementer

LEVELS: dict[str, LogLevel] = {
    "debug": LogLevel.debug,
    "info": LogLevel.info,
    "warn": LogLevel.warn,
    "error": LogLevel.error,
    "critical": LogLevel.critical,
}

#: Keys of legacy (``twisted.python.log``) and logger events that are not the event's fields.
_NOT_FIELDS = frozenset(
    {"message", "system", "isError", "format", "time", "why", "failure", "access_line", "access"}
)
_TOP = ("time", "level", "logger", "message", "worker")


def _time(event: dict[str, Any]) -> str:
    moment = datetime.fromtimestamp(event.get("log_time", 0.0), timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def flat(event: dict[str, Any]) -> dict[str, Any]:
    """An event as one flat, JSON-able object."""
    level = event.get("log_level", LogLevel.info)
    access = event.get("access")
    line: dict[str, Any] = {
        "time": _time(event),
        "level": getattr(level, "name", str(level)),
        "logger": event.get("log_namespace", "-"),
    }
    if isinstance(access, dict):
        line["message"] = f"{access.get('method')} {access.get('path')} {access.get('status')}"
    else:
        line["message"] = formatEvent(event)
    if "worker" in event:
        line["worker"] = event["worker"]
    failure = event.get("log_failure")
    if failure is not None:
        line["error"] = failure.getTraceback()
    fields = access if isinstance(access, dict) else event
    for key, value in fields.items():
        if key in _TOP or key in _NOT_FIELDS or key.startswith("log_") or key in line:
            continue
        if value is None or isinstance(value, (str, int, float, bool)):
            line[key] = value
        elif isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
            line[key] = value  # an access event's attempts and batch parts
    return line


@implementer(ILogObserver)
class JSONLines:
    """One flat JSON object per line."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out

    def __call__(self, event: dict[str, Any]) -> None:
        self._out.write(json.dumps(flat(event), default=str, separators=(",", ":")) + "\n")
        self._out.flush()


def json_lines(out: IO[str] | None = None) -> ILogObserver:
    """Every log event as one flat JSON object per line, on stdout (a ``--logger`` factory)."""
    return JSONLines(out if out is not None else sys.stdout)


@implementer(ILogObserver)
class WorkerTagged:
    """Adds the worker's index to every event: ``worker`` in JSON, ``[worker N ...]`` in text."""

    def __init__(self, observer: ILogObserver, worker: int) -> None:
        self._observer = observer
        self._worker = worker

    def __call__(self, event: dict[str, Any]) -> None:
        system = event.get("log_system")
        if system is None:
            name = getattr(event.get("log_level"), "name", "-")
            system = f"{event.get('log_namespace', '-')}#{name}"
        self._observer(
            dict(event, worker=self._worker, log_system=f"worker {self._worker} {system}")
        )


def log_file(twistd_options: Any) -> IO[str] | None:
    """Where twistd would write its text log (``--logfile``); None: leave it to twistd.

    None for syslog, and for ``twistd --logger=...``: the operator's own
    observer factory (which an application's observer would replace).
    """
    options = twistd_options if twistd_options is not None else {}
    if options.get("syslog") or options.get("logger"):
        return None
    path = options.get("logfile")
    if not path and not options.get("nodaemon", True):
        path = "twistd.log"  # where a daemonized twistd logs by default
    if not path or path == "-":
        return sys.stdout
    return LogFile.fromFullPath(path)


#: The lifecycle lines (the settings in effect, listening, reloaded, draining,
#: stopped): logged at info, and shown at any ``--log-level``.
LIFECYCLE = "nixlproxy.lifecycle"
lifecycle = Logger(namespace=LIFECYCLE)

#: Libraries' own info lines that repeat while something is away (Twisted's
#: ``ClientService``, under txredisapi, says each retry to reach a Redis that is
#: down, once a second): shown at ``--log-level debug`` only; the proxy says
#: once, in words, what they are about.
CHATTER = frozenset({"twisted.application._client_service.ClientService"})


@implementer(ILogFilterPredicate)
class LogLevels:
    """The ``--log-level`` filter, which a SIGHUP reload changes in place.

    Twisted's ``LogLevelFilterPredicate`` splits every event's namespace to
    find its level; this one remembers each namespace's, so an access event
    costs one dictionary lookup.
    """

    def __init__(self, level: str) -> None:
        self.level = level
        self._least = LEVELS[level]
        self._by_namespace: dict[str, LogLevel] = {}

    def set(self, level: str) -> None:
        self.level = level
        self._least = LEVELS[level]
        self._by_namespace = {}

    def _least_for(self, namespace: str) -> LogLevel:
        least = self._least
        if namespace == LIFECYCLE or namespace.startswith(LIFECYCLE + "."):
            least = min(least, LogLevel.info)
        elif namespace in CHATTER and least > LogLevel.debug:
            least = max(least, LogLevel.warn)
        self._by_namespace[namespace] = least
        return least

    def __call__(self, event: dict[str, Any]) -> object:  # a PredicateResult
        level = event.get("log_level")
        if level is None:
            return PredicateResult.no
        namespace = event.get("log_namespace") or ""
        least = self._by_namespace.get(namespace)
        if least is None:
            least = self._least_for(namespace)
        return PredicateResult.no if level < least else PredicateResult.maybe


class TurnBuffered:
    """A log file written once per turn of the reactor: the lines of one turn together.

    Twisted's file observers write and flush every line, a ``write(2)`` per
    request on the reactor's only thread; here a turn's lines (the access
    lines of every request that ended in it) go out in one write at its
    end (``callLater(0)``). While the reactor does not run (starting,
    stopped) each line goes out at once, after any still held, in order.
    Only a process killed outright loses a line: the last turn's.
    """

    def __init__(self, out: IO[str], reactor: Any) -> None:
        self._out = out
        self._reactor = reactor
        self._lines: list[str] = []
        self._due = False

    def write(self, text: str) -> None:
        self._lines.append(text)

    def flush(self) -> None:
        if not self._reactor.running:
            self.write_out()
        elif not self._due and self._lines:
            self._due = True
            self._reactor.callLater(0, self.write_out)

    def write_out(self) -> None:
        """Every line held, in one write."""
        self._due = False
        if self._lines:
            lines, self._lines = self._lines, []
            self._out.write("".join(lines))
            self._out.flush()


@lru_cache(maxsize=4)
def _second(second: int) -> str:
    return formatTime(second, timeFormatRFC3339)


def _time_text(when: float | None) -> str:
    """Twisted's own stamp (to the second, local time), made once a second, not per line."""
    return formatTime(when) if when is None else _second(int(when))


def classic_text(event: dict[str, Any]) -> str | None:
    """An event as ``textFileLogObserver`` writes it.

    An access event, one per request, is its line already rendered
    (``{access_line}``): written here directly, not through Twisted's
    formatter (a ``string.Formatter`` pass and a dozen calls per line),
    to the same text.
    """
    line = event.get("access_line")
    rendered = event.get("log_format") == "{access_line}" and "log_failure" not in event
    if not rendered or not isinstance(line, str) or not line:
        return formatEventAsClassicLogText(event, formatTime=_time_text)
    system = event.get("log_system")
    if system is None:
        level = event.get("log_level")
        system = f"{event.get('log_namespace', '-')}#{'-' if level is None else level.name}"
    text = f"{_time_text(event.get('log_time'))} [{system}] {line}"
    return text.replace("\n", "\n\t") + "\n"


def observer(
    log_format: str,
    levels: LogLevels,
    worker: int | None,
    target: Callable[[], IO[str] | None],
    reactor: Any = None,
) -> ILogObserver | None:
    """The observer these settings need, or None where twistd's own must do.

    ``target`` opens where twistd would log (``log_file``): None for syslog
    or an operator's ``--logger``, whose observer is then twistd's (not
    filtered by ``--log-level``); JSON goes to stdout when that is syslog.
    With a ``reactor``, lines are written once per turn (``TurnBuffered``).
    """
    out = target()
    if out is None and log_format == "json":
        out = sys.stdout
    if out is None:
        return None
    if reactor is not None:
        out = cast(IO[str], TurnBuffered(out, reactor))
    if log_format == "json":
        chosen: ILogObserver = json_lines(out)
    else:
        chosen = FileLogObserver(out, classic_text)
    if worker is not None:
        chosen = WorkerTagged(chosen, worker)
    return FilteringLogObserver(chosen, [levels])


def offer(application: object, chosen: ILogObserver | None) -> None:
    """twistd asks its application for an observer before it logs anything."""
    if chosen is not None and hasattr(application, "setComponent"):
        application.setComponent(ILogObserver, chosen)
