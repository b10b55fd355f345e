"""What Redis answers the replicas, read: a script's replies, the ``freed`` channel's
messages, why a call failed; and the names the keys and the log give Redis."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from twisted.internet import defer
from twisted.python.failure import Failure


def prefix_of(url: str) -> str:
    """Every key's prefix: one hash tag per Redis database, so one shard holds them all."""
    database = urlsplit(url).path.strip("/") or "0"
    return f"nixlproxy:{{fleet-{database}}}:"


def freed(message: str) -> tuple[dict[str, int], int | None]:
    """A ``freed`` message: the slots that changed (``POOL|URL`` -> legs) and the version
    they are as of (None: a nudge, nothing changed)."""
    changed, version = {}, None
    for line in message.splitlines():
        if line.startswith("#"):
            version = int(line[1:])
            continue
        field, _, count = line.rpartition("\t")
        if field:
            changed[field] = int(count)
    return changed, version


def text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def info_of(value: object) -> dict[str, Any]:
    try:
        said = json.loads(text(value))
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


def _view(flat: Sequence[object]) -> dict[str, int]:
    """HGETALL's flat answer as a map (txredisapi may give a dict already)."""
    if isinstance(flat, dict):
        return {text(k): int(v) for k, v in flat.items()}
    return {text(flat[i]): int(text(flat[i + 1])) for i in range(0, len(flat) - 1, 2)}


def view_of(flat: Sequence[object]) -> dict[str, int]:
    """The slots' view in a script's answer."""
    return _view(flat)


def why(failure: Failure, budget: float, connected: bool) -> tuple[str, str]:
    """Why Redis could not say: the reason counted, and what the log says."""
    message = failure.getErrorMessage()
    if failure.check(defer.TimeoutError):
        if connected:
            return "timeout", f"did not answer within {budget * 1000:g} ms"
        return "not_connected", "could not be reached"
    if failure.check("txredisapi.ConnectionError"):
        return "not_connected", f"could not be reached ({message})"
    if failure.check("txredisapi.ResponseError"):
        return "error", f"answered with an error ({message})"
    return "error", f"failed ({type(failure.value).__name__}: {message})"


def shown(url: str) -> str:
    """The URL without its password, as the log may show it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"
