"""The tokens an answer used, as vLLM reports them, read from decode's body as it passes.

vLLM puts ``usage`` at the end: in a whole answer, after the choices; in a
stream, in its last events (``stream_options.include_usage``, Anthropic's
``message_delta``, the Responses API's ``response.completed``). So the
relay keeps only references to the body's last two chunks (no copy, no
parsing on the way), and the last ``"usage": {...}`` in them (at most the
last ``TAIL`` bytes) is read once the body has ended.
The three APIs' names are said one way: prompt, completion and cached tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

#: The bytes read: a usage object and what may follow it (logprobs are before).
TAIL = 8 * 1024

_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Usage:
    """What an answer reported; None where it did not say."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            _sum(self.prompt_tokens, other.prompt_tokens),
            _sum(self.completion_tokens, other.completion_tokens),
            _sum(self.cached_tokens, other.cached_tokens),
        )


def _sum(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else a + b


def read_usage(tail: bytes) -> Usage | None:
    """The last ``"usage": {...}`` object in ``tail``, in one vocabulary; None if none."""
    tail = tail[-TAIL:]
    matches = list(_USAGE.finditer(tail))
    if not matches:
        return None
    found = matches[-1]
    try:
        text = tail[found.end() - 1 :].decode("utf-8", "replace")
        value, _ = _DECODER.raw_decode(text)
    except ValueError:
        return None  # cut off, or not JSON after all
    if not isinstance(value, dict):
        return None
    details = value.get("prompt_tokens_details") or value.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    counts = [
        value.get("prompt_tokens", value.get("input_tokens")),
        value.get("completion_tokens", value.get("output_tokens")),
        cached if cached is not None else value.get("cache_read_input_tokens"),
    ]
    # Whole numbers only (a bool is an int to Python, not to JSON).
    return Usage(*[count if type(count) is int else None for count in counts])


class UsageChunkHidden:
    """An OpenAI stream with its usage-only chunk taken out, as the client would have had it.

    A tenant whose tokens are counted has ``stream_options.include_usage`` asked
    of vLLM for it (``lowering.usage_asked``); a client that did not ask must
    not see the chunk that brings. Events pass whole as they complete (vLLM
    writes each in one piece); a part of one is held until its end arrives.
    """

    def __init__(self) -> None:
        self._held = b""

    def __call__(self, data: bytes) -> bytes:
        data = self._held + data
        end = data.rfind(b"\n\n")
        cut = end + 2 if end >= 0 else 0
        complete, self._held = data[:cut], data[cut:]
        if b'"usage"' not in complete:
            return complete
        events = complete.split(b"\n\n")[:-1]
        return b"".join(event + b"\n\n" for event in events if not _usage_only(event))

    def rest(self) -> bytes:
        """What was held when the stream ended (an event cut short), as it came."""
        held, self._held = self._held, b""
        return held


def _usage_only(event: bytes) -> bool:
    payload = event.strip()
    if not payload.startswith(b"data:") or b'"usage"' not in payload:
        return False
    try:
        chunk = json.loads(payload[5:])
    except ValueError:
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and bool(chunk.get("usage"))
