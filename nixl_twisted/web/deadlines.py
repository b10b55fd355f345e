"""How long a client may take to send a request: its head, then its body.

An idle timer that every byte resets does not stop a client that sends one
byte every few seconds (slowloris): it holds a connection, and with a body
announced, the bytes reserved for it, for ever. So a request's line and
headers have ``header`` seconds, and its body ``body`` seconds plus one per
``body_min_rate`` bytes received (the rule of Apache's mod_reqtimeout): a
large upload at a fair rate always finishes, a trickle does not. Deadlines
are checked once a second, so one is met within a second of it.
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

    @classmethod
    def of(cls, config: ProxyConfig) -> ClientLimits:
        return cls(
            max_body_size=config.limits.max_body_size,
            max_connections=config.limits.max_connections,
            header_timeout=config.timeouts.header,
            body_timeout=config.timeouts.body,
            body_min_rate=config.timeouts.body_min_rate,
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
        self._deadline = 0.0
        self._rate = 0

    def head(self, limits: ClientLimits) -> None:
        """A request's head began (or the connection opened): it has ``header_timeout``."""
        if self.awaiting is None:
            self.awaiting = "header"
            self._deadline = self._clock.seconds() + limits.header_timeout

    def body(self, limits: ClientLimits) -> None:
        """The head is in, a body follows: its clock starts now."""
        self.awaiting = "body"
        self._rate = limits.body_min_rate
        self._deadline = self._clock.seconds() + limits.body_timeout

    def done(self) -> None:
        """The request is in whole: nothing awaited until the next one begins."""
        self.awaiting = None

    def passed(self, now: float, received: int) -> bool:
        """Whether the deadline has passed; a body's earns a second per ``body_min_rate`` bytes."""
        if self.awaiting is None:
            return False
        deadline = self._deadline
        if self.awaiting == "body" and self._rate:
            deadline += received / self._rate
        return now >= deadline
