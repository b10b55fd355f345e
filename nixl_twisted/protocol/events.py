"""SSE events as a body's reads bring them: the whole ones, and the start of the next held.

vLLM writes each event in one piece, but a read may end inside one; what
looks at events one by one (``held``, ``transcript``) takes the whole ones
and holds the rest until its end arrives.
"""

from __future__ import annotations

from nixl_twisted.protocol import routes


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


#: How each two-leg route's event stream ends, as vLLM writes it: chat and text completions
#: with ``data: [DONE]``, Messages with ``message_stop``, Responses with ``response.completed``
#: (``response.incomplete`` past its token limit); an error event ends any of them.
_TERMINAL = {
    routes.CHAT_COMPLETIONS: (b"data: [DONE]", b'data: {"error"'),
    routes.COMPLETIONS: (b"data: [DONE]", b'data: {"error"'),
    routes.MESSAGES: (b"event: message_stop", b"event: error"),
    routes.RESPONSES: (
        b"event: response.completed",
        b"event: response.incomplete",
        b"event: response.failed",
        b"event: error",
    ),
}


def terminal(path: str) -> tuple[bytes, ...]:
    """The events one of which ends ``path``'s stream whole (each at a line's start); a
    stream that ends without one broke off (empty: a route the proxy does not know so)."""
    return _TERMINAL.get(path, ())
