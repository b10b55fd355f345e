"""How a setting's name may be written in a file: with dashes or underscores alike.

The top level of ``--config`` and the ``[models.NAME]`` and ``[tenants.NAME]``
tables read ``decode_only_below`` as ``decode-only-below``; a key written
both ways in one table is refused rather than one of them silently winning,
and a key that is not one of the table's is named in its error, with the
key (or option) it most likely meant: a list of all 90 helps nobody.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from nixl_twisted.config.values import InvalidValue

V = TypeVar("V")


class SpelledTwice(InvalidValue):
    """One key written both ways in one table; ``name``: the key, dashed."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


def dashed(table: Mapping[str, V], where: str) -> dict[str, tuple[str, V]]:
    """Each key of ``table`` as a setting is named, with its spelling as written and
    its value; ``SpelledTwice`` (its message after ``where``) for a key written twice."""
    named: dict[str, tuple[str, V]] = {}
    for written, value in table.items():
        name = str(written).replace("_", "-")
        if name in named:
            first = named[name][0]
            message = f"{where}{first!r} and {written!r} are one key: give it once"
            raise SpelledTwice(message, name)
        named[name] = (str(written), value)
    return named


def known_keys(table: Mapping[str, V], where: str, known: tuple[str, ...]) -> dict[str, V]:
    """A table of ``known`` keys, dashed: ``InvalidValue`` (after ``where``) naming a
    key written twice, or the first that is not one of them."""
    named = dashed(table, where)
    for name, (written, _) in named.items():
        if name not in known:
            hint = did_you_mean(name, known) or f" (the keys are {', '.join(known)})"
            raise InvalidValue(f"{where}unknown key {written!r}{hint}")
    return {name: value for name, (_, value) in named.items()}


def suggestions(name: str, known: Iterable[str]) -> list[str]:
    """The ``known`` names ``name`` most likely meant, best first (at most three, and
    only those about as close as the best): none when nothing is close."""
    scored = sorted(
        ((difflib.SequenceMatcher(None, name, each).ratio(), each) for each in known),
        key=lambda pair: -pair[0],
    )
    close = [(ratio, each) for ratio, each in scored if ratio >= CLOSE]
    return [each for ratio, each in close[:3] if ratio >= close[0][0] - 0.1]


#: How alike two names must be (``difflib``'s ratio) to suggest one for the other.
CLOSE = 0.6


def did_you_mean(name: str, known: Iterable[str], shown: Callable[[str], str] = repr) -> str:
    """``"; did you mean 'x'?"`` (or ``'x' or 'y'``) for a mistyped ``name``; ``""``
    when no ``known`` name is close."""
    found = [shown(each) for each in suggestions(name, known)]
    if not found:
        return ""
    return f"; did you mean {' or '.join(found)}?"
