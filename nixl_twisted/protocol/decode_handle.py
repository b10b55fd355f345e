"""Decode's handle taken out of its answer, and the ids it covers read on the way.

With vLLM's bidirectional KV transfer on, decode answers its own
``kv_transfer_params`` when a two-leg request ends (``docs/protocol.md``,
"Multi-turn reuse"): top level in a whole chat or text completion (and a
Messages answer), inside ``response.completed`` for the Responses API, and
from vLLM 0.33 in the stream's chunk that carries ``finish_reason``. It
names internal hosts and lets its holder read that conversation's KV, so
no client ever gets it, whatever the proxy's options: ``HandleTaker``
cuts the object out of the bytes it passes (an answer's ``null`` is left
as vLLM sent it), and keeps it. Asked to ``collect``, it also reads the
ids decode answered (``return_token_ids``: the prompt's, then each
token's), and with ``strip_ids`` shows them as ``null``, as vLLM does when
the client did not ask.

A whole answer is held until it ends (its ``Content-Length`` then made
what is sent); past ``MAX_HELD`` bytes all but its last ``TAIL`` go on as
they come, without a length. A stream's events pass one by one, each
whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from twisted.web.http_headers import Headers

from nixl_twisted.protocol.events import each, framed
from nixl_twisted.protocol.token_ids import EMPTY_DELTA, LISTED_IDS, listed

#: A whole answer held past this many bytes goes on as it comes, all but its tail.
MAX_HELD = 16 * 1024 * 1024
#: What is held of it then: where the handle is, at its end (a 1M-token prompt's block ids).
TAIL = 4 * 1024 * 1024

_HANDLE = re.compile(rb'"kv_transfer_params"\s*:\s*\{')
#: How decode's handle is named in its answer (a chunk without it passes as it is).
HANDLE_NAME = b'"kv_transfer_params"'
_NAME = HANDLE_NAME
_PROMPT_IDS = re.compile(rb'"prompt_token_ids"\s*:\s*\[([^\]]*)\]')
_ID_NAMES = (b'"token_ids"', b'"prompt_token_ids"')
_DECODER = json.JSONDecoder()
_SPACE = b" \t\r\n"


def cut_handle(data: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """``data`` without its last ``kv_transfer_params`` object (and the comma that joined it),
    and that object (None: none). vLLM writes the handle last in its object; an object of
    that name anywhere before it (a tool's schema echoed) is the client's own, left as it is."""
    for found in reversed(list(_HANDLE.finditer(data))):
        opening = found.end() - 1
        try:
            text = data[opening:].decode("utf-8", "replace")
            value, end = _DECODER.raw_decode(text)
        except ValueError:
            continue  # (not JSON after all: cut short, or not decode's)
        if not isinstance(value, dict):
            continue
        closing = opening + len(text[:end].encode("utf-8", "replace"))
        begin = before = found.start()
        while before > 0 and data[before - 1] in _SPACE:
            before -= 1
        if before > 0 and data[before - 1 : before] == b",":
            begin = before - 1
        else:  # (the first key: the comma after it goes)
            after = closing
            while after < len(data) and data[after] in _SPACE:
                after += 1
            if data[after : after + 1] == b",":
                closing = after + 1
        return data[:begin] + data[closing:], value
    return data, None


def resizing(headers: Headers) -> Callable[[int | None], None]:
    """What tells a client's ``headers`` the length of the whole answer sent (None: none)."""

    def resized(length: int | None) -> None:
        if length is None:
            headers.removeHeader(b"content-length")
        else:
            headers.setRawHeaders(b"content-length", [b"%d" % length])

    return resized


def _ids(listed: bytes) -> list[int] | None:
    try:
        ids = [int(token) for token in listed.split(b",") if token.strip()]
    except ValueError:
        return None
    return ids if all(token >= 0 for token in ids) else None


class HandleTaker:
    """What decode's answer passes through first: its handle taken out, always."""

    def __init__(
        self,
        stream: bool,
        resized: Callable[[int | None], None],
        collect: bool = False,
        strip_ids: bool = False,
        chat: bool = False,
    ) -> None:
        """``resized``: told a whole answer's length as sent (None: unknown: no length);
        ``collect``: the ids are read; ``strip_ids``: shown as ``null``; ``chat``: a chat's
        chunks (one that carried only ids is dropped with them)."""
        self.stream = stream
        self.resized = resized
        self.collect = collect
        self.strip_ids = strip_ids
        self.chat = chat
        #: Decode's handle (None: it answered none).
        self.handle: dict[str, Any] | None = None
        #: The prompt's ids and the answer's, as decode said them (None: not, or not all).
        self.prompt: list[int] | None = None
        self._output: list[int] | None = [] if collect else None
        #: A stream's event cut short, held for its end; a whole answer's chunks, and bytes.
        self._held = b""
        self._chunks: list[bytes] = []
        self._size = 0
        self._looks = collect or strip_ids
        self._unsized = False
        #: Nothing held and nothing to look for but the handle: a stream's whole events pass
        #: unless they name it (the relay looks itself, without a call per token).
        self.idle = stream and not self._looks

    @property
    def tokens(self) -> list[int] | None:
        """The ids decode holds KV for, as its answer said them (None: not all said)."""
        if self.prompt is None or not self._output:
            return None
        return self.prompt + self._output

    @property
    def holding(self) -> bool:
        """A whole answer none of which has gone on yet (should it break, a status says so)."""
        return not self.stream and not self._unsized

    def __call__(self, data: bytes) -> bytes:
        if not self.stream:
            return self._hold(data)
        if not self._held and not self._looks and data[-2:] == b"\n\n" and _NAME not in data:
            return data  # (the steady path: a whole event with nothing to take)
        whole, self._held = framed(self._held, data)
        self.idle = not self._held and not self._looks
        if not whole:
            return b""
        return b"".join(self._event(event) for event in each(whole))

    def rest(self) -> bytes:
        """What was held when decode's answer ended whole, as the client gets it."""
        if self.stream:
            held, self._held = self._held, b""
            return held  # (an event cut short: as it came)
        held = b"".join(self._chunks)
        self._chunks, self._size = [], 0
        body, handle = cut_handle(held)
        if handle is not None:
            self.handle = handle
        if self.collect and not self._unsized:
            self._read_whole(body)
        if self.strip_ids:
            body = self._nulled(body)
        if not self._unsized and len(body) != len(held):
            self.resized(len(body))
        return body

    def _hold(self, data: bytes) -> bytes:
        self._chunks.append(data)
        self._size += len(data)
        if self._size <= MAX_HELD:
            return b""
        if not self._unsized:
            self._unsized = True
            self.resized(None)
            self._output = None  # (its ids are not all read: none kept)
        held = b"".join(self._chunks)
        cut = len(held) - TAIL
        if self.strip_ids:  # (a list of ids, or its name, is never split: it would pass unseen)
            for name in _ID_NAMES:
                opened = held.rfind(name, 0, cut + len(name))
                if opened >= 0 and held.find(b"]", opened, cut) < 0:
                    cut = min(cut, opened)
        passed, rest = held[:cut], held[cut:]
        self._chunks, self._size = [rest], len(rest)
        return self._nulled(passed) if self.strip_ids else passed

    def _read_whole(self, body: bytes) -> None:
        """A whole chat's or text completion's ids: the prompt's at its top or in its one
        choice, the answer's in that choice."""
        try:
            answer = json.loads(body)
        except ValueError:
            return
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return
        prompt = answer.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
        output = choices[0].get("token_ids")
        prompt, output = listed(prompt), listed(output)
        if prompt is not None and output is not None:
            self.prompt, self._output = prompt, output

    def _event(self, event: bytes) -> bytes:
        if _NAME in event:
            event, handle = cut_handle(event)
            if handle is not None:
                self.handle = handle
        if not self._looks:
            return event
        if self.collect and self._output is not None:
            self._read_event(event)
        if self.strip_ids:
            event = self._nulled(event)
            if self.chat and EMPTY_DELTA in event:
                return b""
        return event

    def _read_event(self, event: bytes) -> None:
        if self.prompt is None:
            found = _PROMPT_IDS.search(event)
            if found is not None:
                self.prompt = _ids(found.group(1))
        assert self._output is not None
        for written in LISTED_IDS.findall(event):
            ids = _ids(written)
            if ids is None:
                self._output = None
                return
            self._output += ids

    @staticmethod
    def _nulled(data: bytes) -> bytes:
        data = _PROMPT_IDS.sub(b'"prompt_token_ids":null', data)
        return LISTED_IDS.sub(b'"token_ids":null', data)
