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
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nixl_twisted.backends.holdings import NO_HOLDINGS, Holdings
from nixl_twisted.backends.prefixes import PIECE_BYTES, Pulls, SentPrefixes
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


#: Legs past the guard's cap an instance may take for a prompt it holds (or was sent)
#: most of: moving that prompt computes its prefix again, staying only waits. Two, so
#: that at four instances and one leg in flight (a cap of one), prompts sharing that
#: leg's new prefix still go with it (the guard's cost in hits: ``performance.md``).
FOLLOW = 2


def guard_cap(balance: float, candidates: Sequence[Candidate]) -> int:
    """The balance guard: the legs in flight an instance must be under to take new work.

    ``balance`` times the pool's mean legs in flight, counting this one; a
    prompt that follows its prefix may go to its holder under ``FOLLOW``
    more.
    """
    total = sum(c.in_flight for c in candidates)
    return math.ceil(balance * (total + 1) / len(candidates))


@dataclass(frozen=True)
class CacheAware:
    """Where the longest part of this prompt went before, else the conversation's own instance.

    ``sent`` remembers which instance this proxy sent each prompt prefix to
    (``nixl_twisted.backends.prefixes``). A new prompt goes where its longest
    remembered prefix went when that prefix is at least ``min_match`` of the
    prompt ("prefix": many conversations over one document); otherwise to
    the first instance of its key's rendezvous order ("affinity": a
    conversation's first sight, agreed by every worker and replica). The
    balance guard (``guard_cap``): an instance may hold at most ``balance``
    times the pool's mean legs in flight (plus one) before a new
    conversation takes its key's next instance, and ``FOLLOW`` legs more
    before a prompt leaves the instance that was sent most of it.
    """

    balance: float
    sent: SentPrefixes = field(default_factory=lambda: SentPrefixes(0))
    min_match: float = 0.5
    pulls: Pulls = field(default_factory=Pulls)

    def __call__(self, pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
        if routing.prompt is None:
            return least_loaded(pool, candidates, routing)[0], "no_prompt"
        ordered = rendezvous(routing.prompt, candidates)
        cap = guard_cap(self.balance, candidates)
        chosen, decision = self._remembered(candidates, routing, cap)
        if chosen is None:
            chosen, decision = warm_miss(pool, candidates), WARM_UP
        if chosen is None:
            chosen, decision = min(ordered, key=lambda c: c.in_flight), "balanced"
            for rank, candidate in enumerate(ordered):
                if candidate.in_flight < cap:
                    chosen, decision = candidate, "affinity" if rank == 0 else "balanced"
                    break
        self.sent.sent(routing.chain, chosen.url)
        return chosen, decision

    def _remembered(
        self, candidates: Sequence[Candidate], routing: Routing, cap: int
    ) -> tuple[Any, str]:
        """The candidate sent most of this prompt before, under the guard's cap, if enough
        and if that prefix has not drawn enough prompts there already (``Pulls``)."""
        if not routing.chain:
            return None, ""
        by_url = {c.url: c for c in candidates}
        least = self.min_match * routing.prompt_bytes
        held = [
            (depth, -by_url[url].in_flight, url)
            for url, depth in self.sent.longest(routing.chain, by_url).items()
            if depth * PIECE_BYTES >= least
            and by_url[url].in_flight < cap + FOLLOW
            and not self.pulls.hot(url, routing.chain[depth - 1], routing.prompt)
        ]
        if not held:
            return None, ""
        depth, _, url = max(held)
        self.pulls.drew(url, routing.chain[depth - 1], routing.prompt)
        return by_url[url], "prefix"


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
    (as ``cache-aware``'s memory): a shared system prompt in front of a new
    conversation does not pull every conversation to the instances that
    hold it. Under the same balance guard as ``cache-aware`` (``guard_cap``):
    the longest held prefix wins ("kv_match") while its instance is under
    the cap plus ``FOLLOW``, else the longest on an instance that is
    ("balanced"); nothing worth following goes to the fewest legs in flight
    under the cap ("no_match"). When the index cannot serve (no token ids
    for the prompt, an instance's events not read or stale), ``fallback``
    (``cache-aware``) chooses, and the decision says why: a request never
    fails because of the index.
    """

    balance: float
    held: Holdings
    fallback: CacheAware
    min_match: float = 0.5
    pulls: Pulls = field(default_factory=Pulls)

    def __call__(self, pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
        role = getattr(pool, "role", "")
        why = self._cannot(role, candidates, routing)
        if why is not None:
            return self.fallback(pool, candidates, routing)[0], f"fallback_{why}"
        tokens = routing.tokens
        assert tokens is not None
        reach = self.held.reach(role, tokens, [c.url for c in candidates], routing.salt)
        least = max(1.0, self.min_match * len(tokens))

        def held(candidate: Candidate) -> tuple[int, int, int]:
            found = reach.get(candidate.url)
            if found is None or found.expected < least:
                return (0, 0, -candidate.in_flight)
            if self.pulls.hot(candidate.url, found.last, routing.prompt):
                return (0, 0, -candidate.in_flight)  # (drawn enough there: placed by load)
            return (found.confirmed, found.expected, -candidate.in_flight)

        cap = guard_cap(self.balance, candidates)
        holders = [c for c in candidates if held(c)[1]]
        near = [c for c in holders if c.in_flight < cap + FOLLOW]
        if near:
            chosen = max(near, key=held)
            confirmed, expected, _ = held(chosen)
            if chosen is not max(holders, key=held):
                decision = "balanced"
            else:
                decision = "kv_predicted" if expected > confirmed else "kv_match"
        elif (warm := warm_miss(pool, candidates)) is not None:
            chosen, decision = warm, WARM_UP
        else:
            under = [c for c in candidates if c.in_flight < cap] or list(candidates)
            # New work: the fewest legs in flight, then the least cached (what an instance
            # holds, later prompts follow), as vllm-project/router takes the smallest tree.
            lightest = min((c.in_flight, self.held.blocks(role, c.url)) for c in under)
            chosen = pool.round_robin(
                [c for c in under if (c.in_flight, self.held.blocks(role, c.url)) == lightest]
            )
            drawn = any(r.expected >= least for r in reach.values())  # (but hot, or busy)
            decision = "balanced" if drawn else "no_match"
        found = reach.get(chosen.url)
        if found is not None and held(chosen)[1]:
            self.pulls.drew(chosen.url, found.last, routing.prompt)
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


Policy = Callable[[Pool, Sequence[Candidate], Routing], Choice]


def policies(
    balance: float,
    sent: SentPrefixes | None = None,
    min_match: float = 0.5,
    held: Holdings | None = None,
) -> dict[str, Policy]:
    """Every policy by the name ``settings.POLICIES`` gives it.

    ``balance``, ``sent`` (the pool's memory of prefixes sent) and ``min_match`` are
    cache-aware's; ``held`` (what the KV events say) is kv-aware's.
    """
    cache_aware = CacheAware(balance, sent if sent is not None else SentPrefixes(0), min_match)
    return {
        "round-robin": round_robin,
        "least-loaded": least_loaded,
        "load": by_load,
        "cache-aware": cache_aware,
        "session": session,
        "kv-aware": KvAware(
            balance, held if held is not None else NO_HOLDINGS, cache_aware, min_match
        ),
    }


def policy(
    name: str,
    balance: float,
    sent: SentPrefixes | None = None,
    min_match: float = 0.5,
    held: Holdings | None = None,
) -> Policy:
    """The policy of this name."""
    return policies(balance, sent, min_match, held)[name]
