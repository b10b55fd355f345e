"""Answers that may move only before their first token: a stream's opening, a whole answer.

Where the ids of an answer's tokens are not known (the Responses and
Messages routes, ``protocol.resumable``), or a continuation could not carry
what generated them, the answer moves only while its client has none of
its tokens; its continuation is then the request again:

- ``Opening``: a stream's events before its first token (a chat's role,
  Responses' ``response.created`` ... , Messages' ``message_start`` ...)
  pass as they come and are kept. A request sent again streams the same
  opening with ids and times of its own: those events are dropped, and
  its ids and times made the first opening's in every event after them.
  Past the first token, everything passes as it comes.
- ``Whole``: an answer not streamed, held until it is complete.

Both catch an in-band error event, and hold it and what follows instead of
passing them on (``transcript.is_error``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from nixl_twisted.protocol.events import each, framed
from nixl_twisted.protocol.transcript import is_error, payload

#: How the events that open a stream before its first token begin (Responses, Messages).
_OPENINGS = (
    b"event: response.created",
    b"event: response.in_progress",
    b"event: response.output_item.added",
    b"event: response.content_part.added",
    b"event: message_start",
    b"event: content_block_start",
    b"event: ping",
)
#: What a chat's opening chunk (its role) carries.
_ROLE = b'"delta":{"role"'
#: A whole answer held past this many bytes is relayed as it comes instead (and not moved).
MAX_HELD = 16 * 1024 * 1024


def opens(event: bytes) -> bool:
    """The event opens a stream without carrying a token."""
    return event.startswith(_OPENINGS) or (event.startswith(b"data: ") and _ROLE in event)


def _swaps(first: Any, again: Any, key: str = "") -> Iterator[tuple[bytes, bytes]]:
    """What makes an opening sent again the first: each id (a string) and time (a number)
    of ``again`` that differs from ``first``'s, as it is written, and as it should be."""
    if isinstance(first, dict) and isinstance(again, dict):
        for name, value in first.items():
            if name in again:
                yield from _swaps(value, again[name], name)
    elif isinstance(first, list) and isinstance(again, list):
        for one, other in zip(first, again, strict=False):
            yield from _swaps(one, other, key)
    elif first != again and type(first) is type(again):
        if isinstance(first, str):
            yield json.dumps(again).encode(), json.dumps(first).encode()
        elif isinstance(first, int) and key:
            yield b'"%s":%d' % (key.encode(), again), b'"%s":%d' % (key.encode(), first)


class Opening:
    """A stream moved only before its first token: its opening kept, an error caught."""

    def __init__(self, first: tuple[bytes, ...] = ()) -> None:
        """``first``: the opening the client had of an answer this stream sends again."""
        self._held = b""
        self.error: bytes | None = None
        #: The opening events passed to the client (its first answer's, when sent again).
        self.opening = first
        self._again = list(first)
        #: Its ids and times as they are written, and as the client had them.
        self._swaps: list[tuple[bytes, bytes]] = []
        #: A token passed: nothing more to look at (nothing to make the first's either).
        self.done = False
        self._tokens = False

    @property
    def passed(self) -> bool:
        """Something of the answer reached the client."""
        return bool(self.opening) or self._tokens

    @property
    def tokens(self) -> bool:
        """A token reached the client: a continuation can no longer be the request again."""
        return self._tokens

    def __call__(self, data: bytes) -> bytes:
        if self.error is not None:
            self.error += data
            return b""
        whole, self._held = framed(self._held, data)
        if not whole:
            return b""
        passed = [self._event(event) for event in each(whole)]
        # Past the first token, with nothing to make the first answer's, nothing to look at.
        self.done = self._tokens and not self._swaps and not self._held
        return b"".join(passed)

    def _event(self, event: bytes) -> bytes:
        if self.error is not None or is_error(event):
            self.error = (self.error or b"") + event
            return b""
        if self._again:  # (this answer's own opening: the client has the first's)
            self._swaps += _swaps(payload(self._again.pop(0)), payload(event))
            return b""
        for written, said in self._swaps:
            event = event.replace(written, said)
        if not self._tokens:
            if opens(event):
                self.opening += (event,)
            else:
                self._tokens = True
        return event

    def rest(self) -> bytes:
        held, self._held = self._held, b""
        return held


class Whole:
    """An answer not streamed, held until it is complete: nothing of it reaches the client
    before, so that it can move as a whole (past ``MAX_HELD`` bytes, relayed as it comes)."""

    error: bytes | None = None

    def __init__(self) -> None:
        self._held: list[bytes] = []
        self._size = 0
        self.done = False

    @property
    def passed(self) -> bool:
        return self.done

    def __call__(self, data: bytes) -> bytes:
        self._held.append(data)
        self._size += len(data)
        if self._size <= MAX_HELD:
            return b""
        self.done = True
        return self.rest()

    def rest(self) -> bytes:
        held, self._held = b"".join(self._held), []
        return held
