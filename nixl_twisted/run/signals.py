"""All the signals the proxy and the supervisor take: SIGTERM and SIGHUP, in one place.

twistd's reactor stops on SIGTERM and then re-raises the signal, so the
process would exit with it even after a clean drain. Taking SIGTERM here
stops the reactor the same way (the service tree then stops in its order)
and lets twistd exit 0. SIGHUP's default would kill the process: here it
calls what the tree was given (a proxy reloads its config file; the
supervisor reloads it and sends it to its workers).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from twisted.application.service import Service

from nixl_twisted.logs import lifecycle


class SignalService(Service):
    """Installs the handlers once the reactor runs (it installs its own then)."""

    name = "signals"

    def __init__(self, reactor: Any, on_hangup: Callable[[], None]) -> None:
        self._reactor = reactor
        self._on_hangup = on_hangup

    def startService(self) -> None:
        super().startService()
        self._reactor.callWhenRunning(self._install)

    def _install(self) -> None:
        signal.signal(signal.SIGTERM, self._terminate)
        signal.signal(signal.SIGHUP, self._hangup)

    def _terminate(self, signum: int, frame: FrameType | None) -> None:
        lifecycle.info("SIGTERM: draining requests in flight, then stopping")
        self._reactor.callFromThread(self._reactor.stop)

    def _hangup(self, signum: int, frame: FrameType | None) -> None:
        self._reactor.callFromThread(self._on_hangup)
