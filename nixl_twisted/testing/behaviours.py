"""Scripted behaviours: what a ``FakeVLLM`` does with its next request, as small objects.

A test queues them with ``FakeVLLM.script(...)`` (or the shorthands
``refuse_next``, ``crash_next``, ...); each request takes the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nixl_twisted.testing.answers import vllm_error


@dataclass(frozen=True)
class Behaviour:
    """A normal answer: what every request gets when nothing is scripted."""

    #: A prefill leg answers ``kv_transfer_params``.
    issues_params: bool = True
    #: Cut the answer off: a stream after this many events, a JSON answer halfway.
    cut_after: int | None = None
    #: A stream cut off after this many generated tokens (its opening events before them).
    cut_after_tokens: int | None = None
    #: A stream that answers vLLM's in-band error event after this many generated tokens,
    #: then ends as vLLM ends it (an engine that failed mid-answer).
    error_after_tokens: int | None = None
    #: A stream whose body ends after this many generated tokens as if it were whole (a
    #: hostile or broken instance): no ``[DONE]``, ``message_stop`` or ``response.completed``.
    end_after_tokens: int | None = None
    #: Its answer says other prompt token ids than the request's (a hostile instance).
    other_prompt_ids: bool = False
    #: Keys of the ``kv_transfer_params`` a prefill leg answers, changed (``None``: left out).
    spoiled: tuple[tuple[str, object], ...] = ()

    def instead(self) -> tuple[int, bytes, bytes] | None:
        """(status, content type, body) to answer instead of generating, or None."""
        return None


@dataclass(frozen=True)
class ErrorAnswer(Behaviour):
    """vLLM's OpenAI error body with this status (4xx: a bad request, 5xx: an engine error)."""

    status: int = 400
    message: str = "bad request"

    def instead(self) -> tuple[int, bytes, bytes] | None:
        return self.status, b"application/json", vllm_error(self.status, self.message)


@dataclass(frozen=True)
class RawAnswer(Behaviour):
    """Exactly these bytes, garbage included."""

    status: int = 200
    body: bytes = b""
    content_type: bytes = b"application/json"

    def instead(self) -> tuple[int, bytes, bytes] | None:
        return self.status, self.content_type, self.body


def omit_kv_transfer_params() -> Behaviour:
    """A prefill answer without ``kv_transfer_params``."""
    return Behaviour(issues_params=False)


def spoil_kv_transfer_params(**changes: object) -> Behaviour:
    """A prefill answer whose ``kv_transfer_params`` have these keys changed (None: dropped)."""
    return Behaviour(spoiled=tuple(changes.items()))


def spoiled(params: dict[str, Any], changes: tuple[tuple[str, object], ...]) -> dict[str, Any]:
    """``params`` with ``changes`` made (a key given None left out), the ledger's kept."""
    if not changes:
        return params
    changed = dict(params)
    for key, value in changes:
        if value is None:
            changed.pop(key, None)
        else:
            changed[key] = value
    return changed


def break_off(after_events: int = 1) -> Behaviour:
    """A stream closed after ``after_events`` events; a JSON answer closed halfway."""
    return Behaviour(cut_after=after_events)


def die_after(tokens: int) -> Behaviour:
    """A stream closed after ``tokens`` generated tokens, as by an instance that died."""
    return Behaviour(cut_after_tokens=tokens)


def fail_after(tokens: int) -> Behaviour:
    """A stream that answers vLLM's error event after ``tokens`` generated tokens."""
    return Behaviour(error_after_tokens=tokens)


def end_after(tokens: int) -> Behaviour:
    """A stream whose body ends after ``tokens`` generated tokens without its last event."""
    return Behaviour(end_after_tokens=tokens)


def other_prompt_ids(die_after_tokens: int) -> Behaviour:
    """A stream whose answer says other prompt ids than the request's, closed after
    ``die_after_tokens`` tokens (so that its answer would move)."""
    return Behaviour(cut_after_tokens=die_after_tokens, other_prompt_ids=True)
