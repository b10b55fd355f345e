"""Log observers: JSON lines for log pipelines.

``json_lines`` is an ``ILogObserver`` factory that twistd takes as it is
(``twistd --logger=nixl_twisted.logs.json_lines nixlproxy ...``);
``--log-format json`` is the shorthand that installs the same observer.
"""

from __future__ import annotations

import sys
from typing import IO

from twisted.logger import ILogObserver, jsonFileLogObserver


def json_lines(out: IO[str] | None = None) -> ILogObserver:
    """Every log event as one JSON object per line (no RFC 7464 separator), on stdout."""
    return jsonFileLogObserver(out if out is not None else sys.stdout, recordSeparator="")


def offer_observer(application: object, log_format: str) -> None:
    """``--log-format json``: twistd asks its application for an observer before it logs."""
    if log_format == "json" and hasattr(application, "setComponent"):
        application.setComponent(ILogObserver, json_lines())
