"""What every process's service tree does alike, proxy or ``--workers`` supervisor.

Under twistd it offers the application the log observer that ``tap`` chose,
and on SIGHUP it reads the ``--config`` file again, applies what can change
live and says it in the same lines, whichever process took the signal.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.application.service import MultiService
from twisted.logger import ILogObserver

from nixl_twisted import logs
from nixl_twisted.config import ConfigError, ProxyConfig
from nixl_twisted.run import reloads


class ProcessTree(MultiService):
    """A process's service tree: its configuration, its log observer, its reload."""

    #: What ``twistd nixlproxy`` offers its application (``nixl_twisted.logs``).
    log_observer: ILogObserver | None = None
    #: The ``--log-level`` filter of that observer, which a reload changes.
    log_levels: logs.LogLevels | None = None

    def __init__(self, config: ProxyConfig) -> None:
        super().__init__()
        self.config = config

    def setServiceParent(self, parent: Any) -> None:
        """Under twistd the parent is the application: offer it our log observer."""
        super().setServiceParent(parent)
        logs.offer(parent, self.log_observer)

    def reload(self) -> None:
        """SIGHUP: the ``--config`` file read again, every setting that can change live applied."""
        try:
            reload = reloads.reloaded(self.config, os.environ)
        except ConfigError as error:
            reloads.refused(error)
            return
        self.reconfigure(reload.config)
        reloads.said(reload, self.reached())

    def reconfigure(self, config: ProxyConfig) -> None:
        """Apply ``config``'s live settings; each tree applies its own, then this."""
        if self.log_levels is not None:
            self.log_levels.set(config.log_level)
        self.config = config

    def reached(self) -> str:
        """Who else a reload reached, for the line that says it (the supervisor's workers)."""
        return ""
