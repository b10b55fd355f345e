"""What every process's service tree does alike, proxy or ``--workers`` supervisor.

Under twistd it offers the application the log observer that ``tap`` chose,
and on SIGHUP it reads the ``--config`` file again, applies what can change
live and says it in the same lines, whichever process took the signal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from twisted.application.service import MultiService
from twisted.logger import ILogObserver

from nixl_twisted import logs
from nixl_twisted.config import ConfigError, ProxyConfig
from nixl_twisted.run import reloads


@dataclass(frozen=True)
class Logging:
    """The observer a process logs through (None: twistd's own), and its level filter."""

    observer: ILogObserver | None
    levels: logs.LogLevels


class ProcessTree(MultiService):
    """A process's service tree: its configuration, its log observer, its reload."""

    def __init__(self, config: ProxyConfig, logging: Logging | None = None) -> None:
        """``logging``: the log observer ``twistd nixlproxy`` offers its application
        (``nixl_twisted.logs``), and its ``--log-level`` filter, which a reload changes."""
        super().__init__()
        self.config = config
        self.log_observer = logging.observer if logging is not None else None
        self.log_levels = logging.levels if logging is not None else None

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
