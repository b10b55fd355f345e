"""How long a client may take to send a request: its head, then its body.

An idle timer that every byte resets does not stop a client that sends one
byte every few seconds (slowloris): it holds a connection, and with a body
announced, the bytes reserved for it, for ever. So a request's line and
headers have ``header`` seconds, and its body ``body`` seconds plus one per
``body_min_rate`` bytes received (the rule of Apache's mod_reqtimeout): a
large upload at a fair rate always finishes, a trickle does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from nixl_twisted.config import ProxyConfig


@dataclass(frozen=True)
class ClientLimits:
    """What one client connection may take, read afresh for each request (SIGHUP changes it)."""

    max_body_size: int = 32 * 1024 * 1024
    max_connections: int = 4096
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    body_min_rate: int = 65536

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
    """The deadline of the request a connection is receiving now; ``late`` is told which passed."""

    def __init__(self, clock: IReactorTime, late: Callable[[str], None]) -> None:
        self._clock = clock
        self._late = late
        self._timer: IDelayedCall | None = None
        self._body_deadline = 0.0
        self._rate = 0

    def head(self, limits: ClientLimits) -> None:
        """A request's head began (or the connection opened): it has ``header_timeout``."""
        if self._timer is None:
            self._timer = self._clock.callLater(limits.header_timeout, self._passed, "header")

    def body(self, limits: ClientLimits) -> None:
        """The head is in, a body follows: its clock starts now."""
        self.cancel()
        self._rate = limits.body_min_rate
        self._body_deadline = self._clock.seconds() + limits.body_timeout
        self._timer = self._clock.callLater(limits.body_timeout, self._body_due)

    def received(self, size: int) -> None:
        """``size`` bytes of body arrived: each ``body_min_rate`` of them earn a second."""
        if self._rate:
            self._body_deadline += size / self._rate

    def cancel(self) -> None:
        """The request is in whole (or the connection is gone): no deadline runs."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _body_due(self) -> None:
        left = self._body_deadline - self._clock.seconds()
        if left > 0:
            self._timer = self._clock.callLater(left, self._body_due)
        else:
            self._passed("body")

    def _passed(self, what: str) -> None:
        self._timer = None
        self._late(what)
