"""What a client has been sent of an answer that may move: whole events, and their token ids.

A decode leg that may move to another instance is relayed through one of
these, so that the proxy knows exactly what the client has, and so where a
continuation starts (``protocol.resumable``):

- ``Transcript``: a stream moved at any token (chat and text completions).
  Events reach the client whole; each one's ``token_ids`` (asked of vLLM
  with ``return_token_ids``) are kept as the bytes they came in, and shown
  to the client as ``null``, as vLLM sends them when not asked, unless the
  client asked for them itself. A continuation's events are made the
  answer's: its opening dropped, its id and ``created`` the answer's, its
  usage counting the whole answer.
- ``held.Opening`` and ``held.Whole``: answers moved only before their
  first token (``protocol.held``).

Each catches an in-band error event (vLLM's ``data: {"error": ...}``,
``event: error``), and holds it and what follows instead of passing it on.
Keeping the ids costs a few ``bytes.find`` per event; nothing is parsed
but the opening of each leg.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nixl_twisted.protocol.events import each, framed
from nixl_twisted.protocol.resumable import MAX_RELAYED_TOKENS
from nixl_twisted.protocol.token_ids import EMPTY_DELTA, LISTED_IDS

#: How an in-band error event begins (vLLM's OpenAI routes, Messages, Responses).
_ERRORS = (b'data: {"error"', b"event: error", b"event: response.failed")
_DONE = b"data: [DONE]"
_TOKEN_IDS = b'"token_ids":'
_PROMPT_IDS = b'"prompt_token_ids":'
_CHOICES = re.compile(rb'"choices":\s*\[\s*\{')
_NO_CHOICES = re.compile(rb'"choices":\s*\[\s*\]')
_FINISHED = re.compile(rb'"finish_reason":\s*"')
#: A token event whose text is empty (a chat's content, a text completion's text).
_SAID_NOTHING = re.compile(rb'"(?:content|text)":\s*""')
_CREATED = re.compile(rb'("created":\s*)(\d+)')
_ID = re.compile(rb'"id":\s*("[^"]*")')
_COUNTS = re.compile(rb'"(prompt_tokens|completion_tokens|cached_tokens)":(\s*)(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')
#: Why an answer is not continued when it said other prompt ids than the request's.
PROMPT_MISMATCH = "prompt_mismatch"


def is_error(event: bytes) -> bool:
    """An in-band error event: decode failed after its 200."""
    return event.startswith(_ERRORS)


def payload(event: bytes) -> Any:
    """An event's JSON (its ``data:``), or None."""
    start = event.find(b"{")
    try:
        return json.loads(event[start:]) if start >= 0 else None
    except ValueError:
        return None


def _named(event: bytes) -> tuple[bytes, bytes]:
    """An answer's id and ``created`` as its event writes them (``b'"chatcmpl-1"'``,
    ``b"1765"``; empty where it says none)."""
    answer, created = _ID.search(event), _CREATED.search(event)
    return (
        answer.group(1) if answer is not None else b"",
        created.group(2) if created is not None else b"",
    )


def _list_at(event: bytes, key: bytes) -> tuple[int, int, int] | None:
    """Where the value of ``key`` is in ``event``: (start, end, 1 if a list else 0)."""
    at = event.find(key)
    if at < 0:
        return None
    start = at + len(key)
    while event[start : start + 1] == b" ":
        start += 1
    if event[start : start + 1] != b"[":
        return start, start + 4, 0  # null
    return start, event.find(b"]", start) + 1, 1


def _nulled(event: bytes, key: bytes) -> bytes:
    """``event`` with the list ``key`` holds said as ``null``, as vLLM says it when not asked."""
    found = _list_at(event, key)
    if found is None or not found[2]:
        return event
    return event[: found[0]] + b"null" + event[found[1] :]


class Transcript:
    """A stream moved at any token: what its client has, event by event, as token ids."""

    done = False

    def __init__(self, chat: bool, strip: bool) -> None:
        """``strip``: the client did not ask for token ids (they were asked for the proxy)."""
        self.chat = chat
        self.strip = strip
        self._held = b""
        #: The prompt's ids, as the answer's opening wrote them (``1,2,3``; None: not said).
        self._prompt: bytes | None = None
        #: The ids of the tokens relayed, as they came (``12,13,``).
        self._ids = bytearray()
        #: Events passed to the client (a chunk of several on the steady path counts one).
        self.events = 0
        #: Past the answer's opening, on its first leg, its tokens' ids seen: a chunk of whole
        #: token events takes the steady path (three calls, whatever its events).
        self._steady = False
        #: Why a continuation would not be the answer the client would have had (None: it is).
        self.inexact: str | None = None
        #: The error event caught, and everything after it (None: none).
        self.error: bytes | None = None
        self._last = b""
        #: Chunks on the steady path since the ids' length was last counted.
        self._chunks = 0
        #: The last token relayed said nothing (a chunk dropped: its text held back).
        self._unsaid = False
        #: The answer's id (as JSON) and ``created``; a continuation leg's own.
        self._id = self._created = b""
        self._leg_id: bytes | None = None
        self._leg_created = b""
        #: Tokens relayed before the leg now relayed (0: the first leg), and the cached
        #: prompt tokens its usage says (None: its own).
        self._before = 0
        self._cached: int | None = None
        self._resumed = False

    @property
    def passed(self) -> bool:
        """Something of the answer reached the client."""
        return self.events > 0

    @property
    def prompt(self) -> list[int] | None:
        """The prompt's ids, as the answer's opening said them (None: not, or not ids)."""
        try:
            ids = [int(token) for token in (self._prompt or b"").split(b",")]
        except ValueError:
            return None
        return ids if ids and min(ids) >= 0 else None

    @property
    def tokens(self) -> int:
        """The tokens relayed."""
        return len([token for token in bytes(self._ids).split(b",") if token.strip()])

    def __call__(self, data: bytes) -> bytes:
        """What of ``data`` the client gets now: every event it completes, as the client
        should have it."""
        if (
            self._steady
            and not self._held
            and data[-2:] == b"\n\n"
            and b'data: {"error"' not in data
            and not (self.chat and (b'"delta":{}' in data or b'"reasoning' in data))
        ):
            # Whole token events (vLLM writes one at a time), nothing else to look at: one
            # pass of a regular expression splits out their ids (vLLM sends ids in every
            # token event of a request, or in none: the event-by-event path saw them).
            pieces = LISTED_IDS.split(data)
            ids = pieces[1::2]
            if ids:
                if self.inexact is None:
                    self._ids += b",".join(ids)
                    self._ids += b","
                    self._chunks += 1
                    if self._chunks > MAX_RELAYED_TOKENS:
                        self._bounded()
                if self.strip:
                    data = b'"token_ids":null'.join(pieces[::2])
            self.events += 1
            self._last = data
            self._unsaid = False
            return data
        return self._slow(data)

    def _bounded(self) -> None:
        """Past ``MAX_RELAYED_TOKENS`` chunks: past as many tokens, the ids are let go."""
        self._chunks = 0
        if self._ids.count(b",") > MAX_RELAYED_TOKENS:
            self.inexact, self._ids = "too_long", bytearray()

    def _slow(self, data: bytes) -> bytes:
        """Event by event: an event cut short held, an opening, a continuation's events."""
        if self.error is not None:
            self.error += data
            return b""
        whole, self._held = framed(self._held, data)
        if not whole:
            return b""
        if whole.find(b"\n\n") + 2 == len(whole):  # (one event: as it came)
            return self._event(whole)
        return b"".join([self._event(event) for event in each(whole)])

    def rest(self) -> bytes:
        """What was held when decode's answer ended: an event cut short, as it came."""
        held, self._held = self._held, b""
        return held

    def _event(self, event: bytes) -> bytes:
        if self.error is not None or is_error(event):
            self.error = (self.error or b"") + event
            self._steady = False  # (what follows it is held with it)
            return b""
        if not event.startswith(_DONE):
            if self._resumed:
                event = self._as_answer(event)
                if not event:
                    return b""
            elif not self.events:
                event = self._opening(event)
            event = self._ids_of(event)
            if not event:
                return b""
        self.events += 1
        self._last = event
        return event

    def _opening(self, event: bytes) -> bytes:
        """The answer's first event: its id, its time and the prompt's ids (read where they
        are written, a chat's at the top, a text completion's in its choice)."""
        self._id, self._created = _named(event)
        found = _list_at(event, _PROMPT_IDS)
        if found is None or not found[2]:
            return event
        start, end, _ = found
        self._prompt = event[start + 1 : end - 1]
        return event[:start] + b"null" + event[end:] if self.strip else event

    def _ids_of(self, event: bytes) -> bytes:
        """The event's token ids kept, and shown as the client asked."""
        found = _list_at(event, _TOKEN_IDS)
        if found is None:
            # (a chat's opening says the role, a usage chunk has no choice: neither has ids)
            if _CHOICES.search(event) and not (self.chat and b'"role"' in event):
                self.inexact = self.inexact or "no_token_ids"
            return event
        start, end, listed = found
        if not listed:
            self.inexact = self.inexact or "no_token_ids"
        elif self.inexact is None:
            self._ids += event[start + 1 : end - 1]
            self._ids += b","
            self._steady = not self._resumed
            self._chunks += 1  # (as the steady path counts: one pass per bound's worth)
            if self._chunks > MAX_RELAYED_TOKENS:
                self._bounded()
        if self.chat and b'"reasoning' in event:
            self.inexact = self.inexact or "reasoning"  # (a parser's state no request carries)
        if self.strip and listed:
            event = event[:start] + b"null" + event[end:]
            if self.chat and EMPTY_DELTA in event:
                self._unsaid = True
                return b""  # (vLLM sends it only to carry the ids)
        self._unsaid = False
        return event

    # -- a continuation ---------------------------------------------------------

    def continuation(self, prompt: list[int] | None) -> tuple[list[int], int] | str:
        """The ids of ``prompt`` (the request's own: never what decode's answer said it
        was) and of every token relayed, and how many were relayed; or why no
        continuation is the answer the client would have had (an answer that said other
        prompt ids than ``prompt``: ``PROMPT_MISMATCH``)."""
        if self.inexact is not None:
            return self.inexact
        if prompt is None:
            return "no_token_ids"
        said = self.prompt
        if said is not None and said != prompt:
            return PROMPT_MISMATCH
        last = self._last
        if last.startswith(_DONE) or _FINISHED.search(last) or _NO_CHOICES.search(last):
            return "finished"
        tail = last[last.rfind(b"data: ") :]  # (the last event: a chunk may hold several)
        if self._unsaid or (_SAID_NOTHING.search(tail) and b'"role"' not in tail):
            # vLLM holds back a token's text that ends inside a character; a continuation's
            # detokenizer, starting from its prompt, would write the rest otherwise.
            return "mid_character"
        relayed = [int(token) for token in bytes(self._ids).split(b",") if token.strip()]
        if len(relayed) > MAX_RELAYED_TOKENS:
            return "too_long"
        return prompt + relayed, len(relayed)

    def resume(self, cached: int | None = None) -> None:
        """A continuation's leg is relayed from now on: its events become the answer's;
        ``cached``: the prompt tokens its first prefill found cached, which its usage says
        (None: the continuation's own, of the answer's prompt at most)."""
        self._held = b""
        self.error = None
        self._resumed = True
        self._steady = False
        self._leg_id = None
        self._before = self.tokens
        self._cached = cached

    def _as_answer(self, event: bytes) -> bytes:
        """A continuation's event as the answer's: its opening dropped (a chat's role) or
        without its prompt's ids (a text completion's), its id, time and usage the answer's."""
        if self._leg_id is None:
            self._leg_id, self._leg_created = _named(event)
            if self.chat and b'"role"' in event:
                return b""
            event = _nulled(event, _PROMPT_IDS)
        if self._leg_id and self._leg_id != self._id:
            event = event.replace(self._leg_id, self._id, 1)
        if self._leg_created != self._created:
            event = _CREATED.sub(rb"\g<1>" + self._created, event, count=1)
        if b'"usage"' in event:
            event = self._usage(event)
        return event

    def _usage(self, event: bytes) -> bytes:
        """A continuation's usage as the whole answer's: its prompt less the tokens relayed
        before it, its completion with them (the total is the same), its cached tokens the
        first prefill's (else its own, of the answer's prompt at most)."""
        before, cached = self._before, self._cached
        found = _PROMPT_TOKENS.search(event)
        prompt = int(found.group(1)) - before if found is not None else None

        def counted(count: re.Match[bytes]) -> bytes:
            name, space, value = count.group(1), count.group(2), int(count.group(3))
            if name == b"prompt_tokens":
                value -= before
            elif name == b"completion_tokens":
                value += before
            elif cached is not None:
                value = cached
            elif prompt is not None:
                value = min(value, prompt)
            return b'"%s":%s%d' % (name, space, value)

        return _COUNTS.sub(counted, event)
