"""What Redis answers the replicas, read: a script's replies, the ``freed`` channel's
messages, why a call failed; and the names the keys and the log give Redis."""

from __future__ import annotations

import math
from urllib.parse import urlsplit

from twisted.internet import defer
from twisted.python.failure import Failure


def prefix_of(url: str) -> str:
    """Every key's prefix: one hash tag per Redis database, so one shard holds them all."""
    database = urlsplit(url).path.strip("/") or "0"
    return f"nixlproxy:{{fleet-{database}}}:"


def freed(message: str) -> tuple[dict[str, int], int | None]:
    """A ``freed`` message: the slots that changed (``POOL|URL`` -> legs; a ready lane's key
    -> its requests) and the version they are as of (None: a nudge, nothing changed). A
    message that does not parse is a nudge: the next answer brings the whole view."""
    changed, version = {}, None
    try:
        for line in message.splitlines():
            if line.startswith("#"):
                version = count_of(line[1:])
                continue
            field, _, count = line.rpartition("\t")
            if field:
                changed[field] = count_of(count)
    except WrongReply:
        return {}, None
    return changed, version


def pushed(message: str) -> str | None:
    """The member a ``freed`` message says was pushed out of the full queue (``pushed``,
    then the member), or None: a message of another kind."""
    kind, _, member = message.partition("\n")
    return member if kind == "pushed" and member else None


class WrongReply(Exception):
    """Redis answered a script with a reply of another shape than the script's, or a value
    no script writes (someone else wrote to its keys): Redis is not answering."""

    def __init__(self, reply: object) -> None:
        shown = repr(reply)
        super().__init__(shown if len(shown) <= 80 else shown[:77] + "...")


def text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


#: The largest count a reply may hold (a float holds every whole number to here: Lua's).
COUNT_MAX = 2**53


def count_of(value: object) -> int:
    """A count in a reply (an integer reply, or one written as text): a whole number from 0
    to ``COUNT_MAX``, else ``WrongReply``."""
    if isinstance(value, bool):
        raise WrongReply(value)
    if isinstance(value, int):
        number = value
    elif isinstance(value, (bytes, str)) and text(value).isascii() and text(value).isdigit():
        number = int(text(value))
    else:
        raise WrongReply(value)
    if not 0 <= number <= COUNT_MAX:
        raise WrongReply(value)
    return number


def number_of(value: object) -> float:
    """A finite number in a reply (a score, a time), else ``WrongReply``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, bytes, str)):
        raise WrongReply(value)
    try:
        number = float(text(value) if isinstance(value, bytes) else value)
    except ValueError:
        raise WrongReply(value) from None
    if not math.isfinite(number):
        raise WrongReply(value)
    return number


def view_of(flat: object) -> dict[str, int]:
    """The slots' view in a script's answer (HGETALL's flat list, or the map txredisapi may
    make of it): each field's legs, a count."""
    if isinstance(flat, dict):
        return {text(k): count_of(v) for k, v in flat.items()}
    if not isinstance(flat, (list, tuple)) or len(flat) % 2:
        raise WrongReply(flat)
    return {text(flat[i]): count_of(flat[i + 1]) for i in range(0, len(flat), 2)}


def why(failure: Failure, budget: float, connected: bool) -> tuple[str, str]:
    """Why Redis could not say: the reason counted, and what the log says."""
    message = failure.getErrorMessage()
    if failure.check(defer.TimeoutError):
        if connected:
            return "timeout", f"did not answer within {budget * 1000:g} ms"
        return "not_connected", "could not be reached"
    if failure.check("txredisapi.ConnectionError"):
        return "not_connected", f"could not be reached ({message})"
    if failure.check(WrongReply):
        return "wrong_reply", f"answered with a reply of the wrong shape ({message})"
    if failure.check("txredisapi.ResponseError"):
        return "error", f"answered with an error ({message})"
    return "error", f"failed ({type(failure.value).__name__}: {message})"


def shown(url: str) -> str:
    """The URL without its password, as the log may show it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"
