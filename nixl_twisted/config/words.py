"""How a count reads in a sentence: ``1 replica``, ``2 replicas``, ``0 failures``.

Log lines and error messages say counts; "1 replicas" reads as a bug in the
proxy, and a reader doubts the number with it.
"""

from __future__ import annotations


def counted(count: float, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, the noun plural unless the count is one
    (``plural`` for a noun that does not take an ``s``)."""
    shown = f"{count:g}" if isinstance(count, float) else str(count)
    return f"{shown} {noun if count == 1 else (plural or noun + 's')}"
