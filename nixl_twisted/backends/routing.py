"""Routing policies: which of a pool's usable instances serves the next leg, and why.

A policy sees the candidates (instances neither down, draining nor already
tried for this leg; all of them in panic), what this request offers to route
on (``Routing``) and the pool, and answers an instance and a short decision
that the access event and ``nixlproxy_routing_decisions_total`` carry.

``cache-aware`` and ``session`` hash with rendezvous (highest random weight)
hashing: the choice depends only on the key and the pool's membership, so
every worker and every replica picks the same instance for the same
conversation, and adding or removing an instance moves only the keys that
must move. ``docs/routing.md`` explains each policy and its knobs.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nixl_twisted.backends.holdings import Holdings
from nixl_twisted.backends.prefixes import PIECE_BYTES, SentPrefixes
from nixl_twisted.backends.warm_up import WARM_UP, warm_miss


@dataclass(frozen=True)
class Routing:
    """What one request offers a policy to route on."""

    #: The part of the prompt that every turn of its conversation shares (``prompt_key``).
    prompt: bytes | None = None
    #: ``X-Session-ID``, else the body's ``user``.
    session: str | None = None
    #: The whole prompt as chained pieces (``prefixes.pieces``), and its length in bytes.
    chain: tuple[int, ...] = ()
    prompt_bytes: int = 0
    #: The prompt's token ids as vLLM will see them, for ``kv-aware`` (None: not known),
    #: and why not, when they were asked for and could not be had.
    tokens: tuple[int, ...] | None = None
    untokenized: str | None = None
    #: Per pool role, the tokens of the prompt its ``kv-aware`` choice holds (set by it),
    #: counting the blocks predicted for it.
    matched: dict[str, int] = field(default_factory=dict, compare=False)
    #: Per pool role, what takes back the blocks ``kv-aware`` predicted for its choice.
    predicted: dict[str, Callable[[], object]] = field(default_factory=dict, compare=False)
    #: The model the request is for: only instances that serve it are candidates
    #: (None: any; ``nixl_twisted.backends.models.resolve``).
    model: str | None = None
    #: Its ``cache_salt``: ``kv-aware`` keys its blocks under it, as vLLM does (None: none).
    salt: str | None = None

    def leg_failed(self, role: str) -> None:
        """The leg of that pool failed: the blocks predicted for its instance will not come."""
        withdraw = self.predicted.pop(role, None)
        if withdraw is not None:
            withdraw()


#: A request that offers nothing to route on.
NO_ROUTING = Routing()


class Candidate(Protocol):
    url: str
    in_flight: int
    #: vLLM's own load, as last scraped from its ``/metrics`` (empty if never read).
    load: dict[str, float]


class Pool(Protocol):
    def round_robin(self, candidates: Sequence[Any]) -> Any: ...


Choice = tuple[Any, str]


def round_robin(pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
    return pool.round_robin(candidates), "next"


def least_loaded(pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
    fewest = min(c.in_flight for c in candidates)
    return pool.round_robin([c for c in candidates if c.in_flight == fewest]), "fewest_in_flight"


def load_score(candidate: Candidate) -> float:
    """vLLM's queue as last scraped, less this proxy's legs then, plus this proxy's legs now.

    Between two scrapes a burst from this proxy shows at once in its own
    count; the other clients' share is what the scrape saw beyond ours.
    """
    load = candidate.load
    if not load:
        return float(candidate.in_flight)
    queued = load.get("running", 0.0) + 2 * load.get("waiting", 0.0)
    others = max(0.0, queued - load.get("ours", 0.0))
    return others + candidate.in_flight + 4 * load.get("kv_cache_usage", 0.0)


def by_load(pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
    """Power of two choices on ``load_score``: the better of two at random."""
    pair = random.sample(list(candidates), 2) if len(candidates) > 1 else list(candidates)
    chosen = min(pair, key=load_score)
    return chosen, "load" if chosen.load else "in_flight_only"


def _weight(key: bytes, url: str) -> int:
    digest = hashlib.blake2b(key + b"\0" + url.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: bytes, candidates: Sequence[Candidate]) -> list[Any]:
    """The candidates in this key's order of preference (highest random weight first)."""
    return sorted(candidates, key=lambda c: _weight(key, c.url), reverse=True)


@dataclass(frozen=True)
class Balance:
    """When an instance is measurably busier than the pool's least busy candidate.

    Busy is ``load_score``: this proxy's legs in flight on it, plus vLLM's
    own queue beyond them where its ``/metrics`` are read. An instance is
    busier when it holds at least ``margin`` more than the least busy
    candidate and at least ``factor`` times as much. Only then does a prompt
    leave the instance that holds (or was sent) its prefix: how many prompts
    a prefix drew is never a reason to compute it again, and idle instances
    never balance at all.
    """

    factor: float = 1.5
    margin: float = 4.0

    def busier(self, candidate: Candidate, least: float) -> bool:
        busy = load_score(candidate)
        return busy - least >= self.margin and busy >= self.factor * least

    def calm(self, candidates: Sequence[Candidate]) -> list[Any]:
        """The candidates that are not busier than the least busy (never none)."""
        least = min(load_score(c) for c in candidates)
        return [c for c in candidates if not self.busier(c, least)]


def _best_held(
    held: Sequence[tuple[Any, Any]], calm: Sequence[Candidate]
) -> tuple[Any, bool] | None:
    """Of ``held`` (candidate, how much of the prompt it holds: more is better), the one
    holding most among the ``calm``, and whether it is the one holding most of all."""
    if not held:
        return None
    ranked = sorted(held, key=lambda h: (h[1], -load_score(h[0])), reverse=True)
    for candidate, _ in ranked:
        if candidate in calm:
            return candidate, candidate is ranked[0][0]
    return None


#: How much busier than the least busy (legs) an instance may be and still count as level
#: with it: a prefix shorter than ``--cache-aware-min-match`` draws a prompt only to a level
#: instance. One leg is the least difference load can show.
LEVEL = 1


def _idle_holder(held: Sequence[tuple[Any, Any]], calm: Sequence[Candidate]) -> Any | None:
    """Among the ``calm`` instances level with the least busy (``LEVEL``), the one holding
    most of the prompt, however little (``held``), or None: where load does not choose, a
    hit does."""
    least = min(load_score(c) for c in calm)
    level = [(c, much) for c, much in held if c in calm and load_score(c) <= least + LEVEL]
    return max(level, key=lambda h: (h[1], -load_score(h[0])))[0] if level else None


@dataclass(frozen=True)
class CacheAware:
    """Where the longest part of this prompt went before, else the conversation's own instance.

    ``sent`` remembers which instance this proxy sent each prompt prefix to
    (``nixl_twisted.backends.prefixes``). A new prompt goes where its longest
    remembered prefix went when that prefix is at least ``min_match`` of the
    prompt ("prefix": many conversations over one document); otherwise to
    the first instance of its key's rendezvous order ("affinity": a
    conversation's first sight, agreed by every worker and replica). Either
    stays put unless that instance is measurably busier than the least busy
    (``Balance``): then the calm instance sent most of the prompt, else the
    key's next calm instance ("balanced").
    """

    balance: Balance
    sent: SentPrefixes = field(default_factory=lambda: SentPrefixes(0))
    min_match: float = 0.5

    def __call__(self, pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
        if routing.prompt is None:
            return least_loaded(pool, candidates, routing)[0], "no_prompt"
        calm = self.balance.calm(candidates)
        chosen, decision = self._remembered(candidates, calm, routing)
        moved = decision == "balanced"  # (its prefix's instance was busier)
        if chosen is None:
            chosen, decision = warm_miss(pool, candidates), WARM_UP
        if chosen is None:
            ordered = rendezvous(routing.prompt, candidates)
            chosen = next(c for c in ordered if c in calm)
            decision = "affinity" if chosen is ordered[0] and not moved else "balanced"
        self.sent.sent(routing.chain, chosen.url)
        return chosen, decision

    def _remembered(
        self, candidates: Sequence[Candidate], calm: Sequence[Candidate], routing: Routing
    ) -> tuple[Any, str]:
        """The calm candidate sent most of this prompt before, if that is enough of it."""
        if not routing.chain:
            return None, ""
        by_url = {c.url: c for c in candidates}
        least = self.min_match * routing.prompt_bytes
        sent = [
            (by_url[url], depth) for url, depth in self.sent.longest(routing.chain, by_url).items()
        ]
        held = [(c, depth) for c, depth in sent if depth * PIECE_BYTES >= least]
        best = _best_held(held, calm)
        if best is not None:
            chosen, first = best
            return chosen, "prefix" if first else "balanced"
        idle = _idle_holder(sent, calm)
        if idle is not None:
            return idle, "balanced" if held else "prefix"
        return None, "balanced" if held else ""


@dataclass(frozen=True)
class KvAware:
    """The instance that holds the longest prefix of this prompt, by vLLM's own KV events.

    Held means confirmed by the events first, then predicted: when it
    chooses, the blocks the prompt will fill are recorded for the chosen
    instance at once (``Holdings.predict``), so a prompt sharing them that
    comes before vLLM reports them goes there too ("kv_predicted"). A
    prediction never outweighs a confirmed hit: instances are ranked by
    their confirmed prefix, and the predicted part only breaks ties.

    A prefix is followed when it is at least ``min_match`` of the prompt
    (as ``cache-aware``'s memory), unless its instance is measurably busier
    than the least busy (``Balance``): then the calm instance holding most
    ("balanced"). Nothing worth following goes to the least busy calm
    instance, then the least cached ("no_match"). When the index cannot
    serve (no token ids for the prompt, an instance's events not read or
    stale), ``fallback`` (``cache-aware``) chooses, and the decision says
    why: a request never fails because of the index.
    """

    balance: Balance
    held: Holdings
    fallback: CacheAware
    min_match: float = 0.5

    def __call__(self, pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
        role = getattr(pool, "role", "")
        why = self._cannot(role, candidates, routing)
        if why is not None:
            return self.fallback(pool, candidates, routing)[0], f"fallback_{why}"
        tokens = routing.tokens
        assert tokens is not None
        reach = self.held.reach(role, tokens, [c.url for c in candidates], routing.salt)
        least = max(1.0, self.min_match * len(tokens))
        holding = [
            (c, (found.confirmed, found.expected))
            for c in candidates
            if (found := reach.get(c.url)) is not None and found.expected
        ]
        held = [(c, much) for c, much in holding if much[1] >= least]
        calm = self.balance.calm(candidates)
        best = _best_held(held, calm)
        if best is None and (idle := _idle_holder(holding, calm)) is not None:
            best = idle, not held  # (under min-match, where load does not decide)
        if best is not None:
            chosen, first = best
            found = reach[chosen.url]
            if not first:
                decision = "balanced"
            else:
                decision = "kv_predicted" if found.expected > found.confirmed else "kv_match"
        elif (warm := warm_miss(pool, candidates)) is not None:
            chosen, decision = warm, WARM_UP
        else:
            # New work: the least busy, then the least cached (what an instance holds,
            # later prompts follow), as vllm-project/router takes the smallest tree.
            def lightness(c: Candidate) -> tuple[float, int]:
                return (load_score(c), self.held.blocks(role, c.url))

            lightest = min(lightness(c) for c in calm)
            chosen = pool.round_robin([c for c in calm if lightness(c) == lightest])
            decision = "balanced" if held else "no_match"
        found = reach.get(chosen.url)
        routing.matched[role] = found.expected if found is not None else 0
        routing.predicted[role] = self.held.predict(role, chosen.url, tokens, routing.salt)
        return chosen, decision

    def _cannot(self, role: str, candidates: Sequence[Candidate], routing: Routing) -> str | None:
        if routing.tokens is None:
            return routing.untokenized or "no_tokens"
        if not all(self.held.listening(role, c.url) for c in candidates):
            return "no_events"
        if any(self.held.stale(role, c.url) for c in candidates):
            return "stale"
        return None


def session(pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
    if routing.session is None:
        return pool.round_robin(candidates), "no_session"
    # (A lone surrogate, valid as a JSON escape, not as UTF-8, kept as is.)
    key = routing.session.encode("utf-8", "surrogatepass")
    return rendezvous(key, candidates)[0], "session"


#: A routing policy: the pool, its candidates and what the request offers, to an instance
#: and a decision (``policies.REGISTRY`` knows each by name, and what it reads).
Policy = Callable[[Pool, Sequence[Candidate], Routing], Choice]
