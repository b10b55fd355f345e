"""The routing policies by name, each with what it reads: the one place a name means a policy.

A policy is a callable (``routing.Policy``) that chooses among a pool's
candidates. The registry (``REGISTRY``) knows each by its name, says what
it reads (``Needs``: the prompt as text, the session key, the prompt's token
ids, vLLM's load, vLLM's KV events, the pool's memory of prefixes sent) and
makes it from the pool's parts (``Parts``). Whatever asks "does a policy
here need X" (the prompt keys, the health checks' scrape of vLLM's load,
the KV events' subscriptions, the render of token ids, the status page's
hit rate) asks the registry, never a name: a new policy is its module and
one line of ``REGISTRY`` (``docs/routing.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from nixl_twisted.backends.holdings import NO_HOLDINGS, Holdings
from nixl_twisted.backends.prefixes import SentPrefixes
from nixl_twisted.backends.routing import (
    Balance,
    CacheAware,
    KvAware,
    Policy,
    by_load,
    least_loaded,
    round_robin,
    session,
)


@dataclass(frozen=True)
class Needs:
    """What a policy reads besides the candidates' health and legs in flight."""

    #: The prompt rendered as text: its conversation key and its chained pieces.
    prompt_text: bool = False
    #: ``X-Session-ID``, else the body's ``user``.
    session_key: bool = False
    #: The prompt's token ids as vLLM sees them (vLLM renders them when the prompt is text).
    token_ids: bool = False
    #: vLLM's own load, read from each instance's ``/metrics`` by the health checks.
    load: bool = False
    #: vLLM's KV events: each instance is asked where it publishes them, and followed.
    kv_events: bool = False
    #: The pool's memory of which instance was sent which prompt prefix (``SentPrefixes``).
    sent_prefixes: bool = False

    def __or__(self, other: Needs) -> Needs:
        return Needs(
            self.prompt_text or other.prompt_text,
            self.session_key or other.session_key,
            self.token_ids or other.token_ids,
            self.load or other.load,
            self.kv_events or other.kv_events,
            self.sent_prefixes or other.sent_prefixes,
        )

    @property
    def finds_prefixes(self) -> bool:
        """Its decisions say whether the prompt's prefix is where they send it (its memory of
        prefixes sent, or the KV events): the status page's hit rate counts them."""
        return self.sent_prefixes or self.kv_events


#: A policy that reads nothing but the candidates.
NOTHING = Needs()


@dataclass(frozen=True)
class Parts:
    """What a pool's policies are made with: the balance guard, the pool's memory of prefixes
    sent and the share of a prompt a remembered prefix must cover, what the KV events say."""

    balance: Balance = field(default_factory=Balance)
    sent: SentPrefixes = field(default_factory=lambda: SentPrefixes(0))
    min_match: float = 0.5
    held: Holdings = NO_HOLDINGS


class PolicyKind(Protocol):
    """A policy as the registry knows it: its name, what it reads, how it is made for a pool."""

    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> Needs: ...

    def make(self, parts: Parts) -> Policy: ...


@dataclass(frozen=True)
class Declared:
    """A ``PolicyKind`` in one line: its name, what it reads, and what makes it."""

    name: str
    needs: Needs
    maker: Callable[[Parts], Policy]

    def make(self, parts: Parts) -> Policy:
        return self.maker(parts)


def _cache_aware(parts: Parts) -> CacheAware:
    return CacheAware(parts.balance, parts.sent, parts.min_match)


def _kv_aware(parts: Parts) -> KvAware:
    # (cache-aware chooses when the index cannot: it reads what cache-aware reads too)
    return KvAware(parts.balance, parts.held, _cache_aware(parts), parts.min_match)


_PREFIXES = Needs(prompt_text=True, sent_prefixes=True)

#: Every policy by its name, in the order ``--help`` and ``docs/routing.md`` give them
#: (``config.values.POLICIES``, which the settings check names against, is held equal by a test).
REGISTRY: dict[str, PolicyKind] = {
    kind.name: kind
    for kind in (
        Declared("round-robin", NOTHING, lambda parts: round_robin),
        Declared("least-loaded", NOTHING, lambda parts: least_loaded),
        Declared("load", Needs(load=True), lambda parts: by_load),
        Declared("cache-aware", _PREFIXES, _cache_aware),
        Declared("session", Needs(session_key=True), lambda parts: session),
        Declared("kv-aware", _PREFIXES | Needs(token_ids=True, kv_events=True), _kv_aware),
    )
}


def needs(names: Iterable[str]) -> Needs:
    """What the policies of these names read, together."""
    together = NOTHING
    for name in names:
        together = together | REGISTRY[name].needs
    return together


def finds_prefixes(name: str) -> bool:
    """Whether the policy of this name looks for a prompt's prefix (unknown: no)."""
    kind = REGISTRY.get(name)
    return kind is not None and kind.needs.finds_prefixes


@dataclass(frozen=True)
class InUse:
    """A policy a pool chooses by: its name (for the metrics and the spans), itself, its needs."""

    name: str
    policy: Policy
    needs: Needs


@dataclass(frozen=True)
class Chosen:
    """A pool's policies: its own, each model's own (``[models.NAME]``), and what they read
    together (what its instances are read for)."""

    default: InUse
    by_model: Mapping[str, InUse] = field(default_factory=dict)

    @property
    def needs(self) -> Needs:
        together = self.default.needs
        for used in self.by_model.values():
            together = together | used.needs
        return together


def chosen(name: str, parts: Parts, own: Mapping[str, str] | None = None) -> Chosen:
    """The pool's policy ``name`` and each model's ``own`` (model to name), made with ``parts``
    (each name made once, shared by the models that name it)."""
    own = own or {}
    made = {
        named: InUse(named, REGISTRY[named].make(parts), REGISTRY[named].needs)
        for named in {name, *own.values()}
    }
    return Chosen(made[name], {model: made[named] for model, named in own.items()})


#: A pool no configuration has given a policy yet.
ROUND_ROBIN = chosen("round-robin", Parts())
