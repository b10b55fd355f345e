"""What a SIGHUP says: what changed, and, in one warning, what it could not change.

The proxy and the ``--workers`` supervisor reload alike
(``ProxyConfig.reloaded``); both say it here, so an operator reads the same
lines whichever process took the signal.
"""

from __future__ import annotations

from twisted.logger import Logger

from nixl_twisted.config import ConfigError, Reload
from nixl_twisted.logs import lifecycle

log = Logger()


def refused(error: ConfigError) -> None:
    """The file could not be used: nothing changed."""
    log.error("SIGHUP: nothing reloaded, every setting kept as it was ({key}): {error}",
              key=error.key, error=str(error))  # fmt: skip


def said(reload: Reload, where: str = "") -> None:
    """The reload's outcome: one info line, and one warning for what it did not apply."""
    config = reload.config
    lifecycle.info(
        "SIGHUP: reloaded {path}{where}: {changed}",
        path=config.config_path,
        where=where,
        changed=("changed " + ", ".join(reload.changed)) if reload.changed else "nothing changed",
        reloaded=list(reload.changed),
    )
    if reload.need_restart or reload.overridden:
        parts = []
        if reload.need_restart:
            parts.append(
                "take a restart to change, kept as they were: " + ", ".join(reload.need_restart)
            )
        if reload.overridden:
            parts.append(
                "set on the command line, which wins over the file: " + ", ".join(reload.overridden)
            )
        log.warn("SIGHUP: settings not applied: {parts}", parts="; ".join(parts),
                 need_restart=list(reload.need_restart),
                 overridden=list(reload.overridden))  # fmt: skip
