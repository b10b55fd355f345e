"""How long a client may take to send a request: its head, then its body.

An idle timer that every byte resets does not stop a client that sends one
byte every few seconds (slowloris): it holds a connection, and with a body
announced, the bytes reserved for it, for ever. So a request's line and
headers have ``header`` seconds, and its body ``body`` seconds plus one per
``body_min_rate`` bytes received (the rule of Apache's mod_reqtimeout): a
large upload at a fair rate always finishes, a trickle does not.

Two more bounds keep a body that arrived almost whole from holding the
bytes it has (``--max-buffered-bodies``) with the time it earned: it has
``body_max`` seconds in all (mod_reqtimeout's maximum), and it must bring
``body_min_rate`` bytes in every ``body`` seconds (a body that stalls is
408 at the end of the window it stalled in, whatever it earned before).
Deadlines are checked once a second, so one is met within a second of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from twisted.internet.interfaces import IReactorTime

from nixl_twisted.config import ProxyConfig


@dataclass(frozen=True)
class ClientLimits:
    """What one client connection may take, read afresh for each request (SIGHUP changes it).

    Made from a configuration only (``of``): the defaults live in the settings table.
    """

    max_body_size: int
    max_connections: int
    header_timeout: float
    body_timeout: float
    body_min_rate: int
    body_max_timeout: float

    @classmethod
    def of(cls, config: ProxyConfig) -> ClientLimits:
        return cls(
            max_body_size=config.limits.max_body_size,
            max_connections=config.limits.max_connections,
            header_timeout=config.timeouts.header,
            body_timeout=config.timeouts.body,
            body_min_rate=config.timeouts.body_min_rate,
            body_max_timeout=max(config.timeouts.body_max, config.timeouts.body),
        )


class RequestDeadlines:
    """The deadline of the request a connection is receiving now, if any.

    No timer per request: the site looks at every connection's deadline
    once a second (``TrackingSite``), so a request costs two clock readings.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        #: "header" or "body" while one is awaited; None between requests.
        self.awaiting: str | None = None
        #: The body brought fewer than ``body_min_rate`` bytes in its last window.
        self.stalled = False
        self._deadline = 0.0
        self._rate = 0
        self._ceiling = 0.0
        self._window = 0.0
        #: When the body's window began, and the bytes it had received then.
        self._mark = (0.0, 0)

    def head(self, limits: ClientLimits) -> None:
        """A request's head began (or the connection opened): it has ``header_timeout``."""
        if self.awaiting is None:
            self.awaiting = "header"
            self._deadline = self._clock.seconds() + limits.header_timeout

    def body(self, limits: ClientLimits) -> None:
        """The head is in, a body follows: its clock starts now."""
        now = self._clock.seconds()
        self.awaiting = "body"
        self.stalled = False
        self._rate = limits.body_min_rate
        self._deadline = now + limits.body_timeout
        self._ceiling = now + limits.body_max_timeout
        self._window = limits.body_timeout
        self._mark = (now, 0)

    def done(self) -> None:
        """The request is in whole: nothing awaited until the next one begins."""
        self.awaiting = None

    def passed(self, now: float, received: int) -> bool:
        """Whether the deadline has passed; a body's earns a second per ``body_min_rate``
        bytes, up to its ceiling, while each window brings ``body_min_rate`` bytes."""
        if self.awaiting is None:
            return False
        if self.awaiting == "header" or not self._rate:
            return now >= self._deadline
        began, had = self._mark
        if now - began >= self._window:
            if received - had < self._rate:
                self.stalled = True
                return True
            self._mark = (now, received)
        return now >= min(self._deadline + received / self._rate, self._ceiling)
