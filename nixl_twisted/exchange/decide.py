"""Whether a completion takes a prefill leg: decided per request, once its decode instance is known.

Like llm-d's decider, the rules run after the decode instance is chosen
and before the prefill instance is: a prompt the decode instance can
compute about as fast as the proxy can run a second exchange and vLLM can
move the blocks skips prefill (``decode_only``), and is computed there.
Every rule is off by default (``Disaggregation``), which is today's
behaviour: always two legs. ``docs/routing.md`` explains each rule and
when not to use them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.config import Disaggregation
from nixl_twisted.protocol.completion import Completion


class Mode(enum.Enum):
    #: A prefill leg, then a decode leg that pulls its blocks.
    PD = "pd"
    #: The decode leg alone, with no ``kv_transfer_params``: decode computes the prompt.
    DECODE_ONLY = "decode_only"


class Reason(enum.Enum):
    """The rule that decided (the ``reason`` label, the access event's ``decided_by``)."""

    #: No rule is set: every request takes two legs.
    ALWAYS = "always"
    #: Rules are set; none of them applied.
    LONG_PROMPT = "long_prompt"
    SHORT_PROMPT = "short_prompt"
    CACHED_ON_DECODE = "cached_on_decode"
    PREFILL_UNAVAILABLE = "prefill_unavailable"
    PREFILL_BUSY = "prefill_busy"


@dataclass(frozen=True)
class Decision:
    mode: Mode
    reason: Reason


ALWAYS = Decision(Mode.PD, Reason.ALWAYS)
#: ``--prefill-fallback decode``, when no prefill instance can serve.
FALLBACK = Decision(Mode.DECODE_ONLY, Reason.PREFILL_UNAVAILABLE)
_LONG = Decision(Mode.PD, Reason.LONG_PROMPT)
_SHORT = Decision(Mode.DECODE_ONLY, Reason.SHORT_PROMPT)
_CACHED = Decision(Mode.DECODE_ONLY, Reason.CACHED_ON_DECODE)
_BUSY = Decision(Mode.DECODE_ONLY, Reason.PREFILL_BUSY)


class Holdings(Protocol):
    """How many of a prompt's tokens an instance holds in its prefix cache (from its KV events)."""

    def cached_tokens(
        self, instance: Instance, tokens: Sequence[int], salt: str | None = None
    ) -> int | None:
        """None: not known (no events read from that instance, or its index stale); ``salt``:
        the prompt's ``cache_salt``."""


def prefill_load(instance: Instance) -> float:
    """This proxy's legs in flight to a prefill instance, plus vLLM's waiting queue if scraped."""
    return instance.in_flight + instance.load.get("waiting", 0.0)


def decide(
    rules: Disaggregation,
    completion: Completion,
    decode: Instance | None,
    prefill: BackendPool,
    holdings: Holdings | None = None,
    token_ids: Sequence[int] | None = None,
) -> Decision:
    """Two legs, or decode alone, for this request on the ``decode`` instance chosen or named
    for it (None: none yet, and the cached rule does not apply).

    In order: no usable prefill instance (with the fallback on); a short
    prompt; a prompt mostly cached on ``decode``; a short-ish prompt while
    every usable prefill instance is busy. ``token_ids``: the prompt's, when
    known (rendered by vLLM), counted exactly; otherwise estimated, and a
    prompt the proxy cannot measure (``Completion.estimate``: None) always
    takes two legs. The cached rule needs the token ids.
    """
    if rules.fallback == "decode" and not _usable(prefill):
        return FALLBACK
    if rules.always:
        return ALWAYS
    tokens = len(token_ids) if token_ids is not None else completion.estimate
    if tokens is None:
        return _LONG
    if tokens < rules.short_prompt:
        return _SHORT
    if rules.uncached and holdings is not None and token_ids is not None and decode is not None:
        cached = holdings.cached_tokens(decode, token_ids, completion.salt)
        if cached is not None and tokens - cached < rules.uncached:
            return _CACHED
    if tokens < rules.busy_prompt and _busy(prefill, rules.busy_at):
        return _BUSY
    return _LONG


def _usable(pool: BackendPool) -> list[Instance]:
    return [i for i in pool.instances if pool.available(i)]


def _busy(pool: BackendPool, at: int) -> bool:
    """Every usable prefill instance is at ``at`` load or more (none usable: not busy, but down)."""
    usable = _usable(pool)
    return bool(usable) and all(prefill_load(i) >= at for i in usable)


def blind_rules(rules: Disaggregation, decode_events: bool) -> str | None:
    """What a set rule cannot see, said once at startup and at a reload that sets it.

    ``decode_events``: some decode instance's KV events are read (a URL's
    ``#kv-events=`` or ``--decode-kv-events-port``); without them the proxy
    never knows what a decode instance caches.
    """
    if rules.uncached and not decode_events:
        return (
            "--decode-only-uncached-below does nothing: it needs to know what each decode "
            "instance caches, from vLLM's KV events; set --decode-kv-events-port or "
            "#kv-events=PORT on the decode URLs"
        )
    return None


def describe(rules: Disaggregation) -> str:
    """The rules in effect, for the startup summary."""
    said = []
    if rules.short_prompt:
        said.append(f"decode-only below {rules.short_prompt} tokens")
    if rules.uncached:
        said.append(f"decode-only with under {rules.uncached} tokens uncached")
    if rules.busy_prompt:
        said.append(
            f"decode-only below {rules.busy_prompt} tokens while prefill is busy "
            f"(at {rules.busy_at})"
        )
    if rules.fallback == "decode":
        said.append("decode-only when no prefill instance can serve")
    return ", ".join(said) if said else "two legs always"
