"""SSE events as a body's reads bring them: the whole ones, and the start of the next held.

vLLM writes each event in one piece, but a read may end inside one; what
looks at events one by one (``held``, ``transcript``) takes the whole ones
and holds the rest until its end arrives.
"""

from __future__ import annotations


def framed(held: bytes, data: bytes) -> tuple[bytes, bytes]:
    """``data`` read after ``held``: its whole events (b"" while none has ended), and what
    is held for the next read."""
    if held:
        data = held + data
    end = data.rfind(b"\n\n") + 2
    if end == 1:
        return b"", data
    return data[:end], data[end:]


def each(whole: bytes) -> list[bytes]:
    """``framed``'s whole events, one by one, each with its blank line."""
    return [event + b"\n\n" for event in whole.split(b"\n\n")[:-1]]
