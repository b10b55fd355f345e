"""``Instance``: one vLLM instance of a pool, and what the proxy knows of it.

Its URL (with its data-parallel rank, if any), its health as the rules of
``nixl_twisted.backends.health`` judge it, the legs it serves now, whether it drains,
and vLLM's own load as last scraped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nixl_twisted.backends.health import State


@dataclass(eq=False)
class Instance:
    """One vLLM instance and what the proxy knows of its health."""

    url: str
    role: str
    state: State = State.PENDING
    #: Failures in a row, and successes in a row.
    failures: int = 0
    successes: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    #: Legs being served by this instance now.
    in_flight: int = 0
    #: No new legs; the instance leaves its pool when its last leg ends.
    draining: bool = False
    #: vLLM's own load from its ``/metrics`` (``running``, ``waiting``,
    #: ``kv_cache_usage``) and this proxy's legs then (``ours``); empty if unread.
    load: dict[str, float] = field(default_factory=dict)
    #: Where it publishes its KV cache events, as its URL says (``kv-events``,
    #: ``kv-replay``: a port on its host, or ``tcp://HOST:PORT``); else the pool's.
    kv: dict[str, str] = field(default_factory=dict)
    #: What lists it: ``static`` (the pools' URLs), ``admin`` (the admin API), or a
    #: discovery source (``dns+http://NAME:PORT``, ``kubernetes:NS/SELECTOR``); it
    #: drains once none does.
    sources: set[str] = field(default_factory=set)
    #: The source that first listed it (what it shows once none lists it).
    came_from: str = "static"
    #: The models it serves, as its ``GET /v1/models`` said last (id -> card; LoRA
    #: adapters too); None: not read (health checks off, or it could not be read).
    models: dict[str, dict[str, Any]] | None = None
    #: The models ``[models.NAME]`` lists it under (served until it says what it serves).
    named: frozenset[str] = frozenset()
    #: The legs its URL says it takes at once (``#max-in-flight=N``; None: its pool's).
    own_cap: int | None = None
    #: The legs this process may hold on it at once (``backends.capacity``; None: no cap).
    slots: int | None = None
    #: This process's share of its cap, such that the shares of every process add up to
    #: the cap (the saturation signal's slots): its static share, or under
    #: ``--replicas-redis`` the cap over the replicas alive (``admission.shared_slots``).
    cap_share: float | None = None
    #: Under ``--replicas-redis``, its caps over the live replicas (``fleet.caps``: its
    #: ``lowest``, which the fleet holds it to, and ``highest``); None: not read.
    fleet_cap: Any = None
    #: It answered 503 (its engine's queue full): no leg goes to it before this time.
    full_until: float = 0.0
    #: Its legs failed in a row, its ejections lately, until when it is out of rotation,
    #: and its ejections in all (``backends.outliers``).
    leg_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    ejected_total: int = 0
    #: It joined lately (added, discovered, up again): until then it takes the cache
    #: policies' misses (``backends.warm_up``).
    warm_until: float = 0.0
    #: Prompt tokens of the decode-only legs this process sent it (computed there on
    #: purpose), estimated; what ``backends.recompute`` takes off decode's local compute.
    alone_tokens: float = 0.0
    #: The share of P/D legs' prompt tokens it computed itself over the last window
    #: (``backends.recompute``; None: not judged yet), and the episodes so far.
    recompute: float | None = None
    recompute_episodes: int = 0
    #: Told when it is marked down: the relays of answers that may move to another
    #: instance (``exchange.migration``).
    on_down: set[Callable[[], object]] = field(default_factory=set)

    def marked_down(self) -> None:
        """It was just marked down: whoever is still relaying an answer from it is told."""
        for told in list(self.on_down):
            told()

    def serves(self, model: str) -> bool:
        """Whether a request for ``model`` may go here (``nixl_twisted.backends.models``):
        what its ``/v1/models`` said, else what a table lists it under, else anything."""
        if self.models is not None:
            return model in self.models
        return model in self.named if self.named else True

    @property
    def not_serving(self) -> list[str]:
        """The models a table lists it under that its ``/v1/models`` does not: it takes
        none of their requests (vLLM would refuse them)."""
        if self.models is None:
            return []
        return sorted(self.named.difference(self.models))

    @property
    def healthy(self) -> bool:
        return self.state is State.UP

    @property
    def base(self) -> str:
        """Where its legs go: the URL without its rank."""
        return self.url.split("#", 1)[0]

    @property
    def declared(self) -> str:
        """Its URL as a pool is given it: with its KV event ports and its cap, if its own."""
        said = [f"{name}={self.kv[name]}" for name in sorted(self.kv)]
        if self.own_cap is not None:
            said.append(f"max-in-flight={self.own_cap}")
        if not said:
            return self.url
        return f"{self.url}{'&' if '#' in self.url else '#'}{'&'.join(said)}"

    @property
    def rank(self) -> int | None:
        """Its data-parallel rank (``URL#rank=I``), sent as ``X-data-parallel-rank``."""
        _, _, fragment = self.url.partition("#")
        return int(fragment.removeprefix("rank=")) if fragment else None

    @property
    def source(self) -> str:
        """Where it came from: ``static``, ``admin``, ``dns``, ``dnssrv`` or ``kubernetes``."""
        kinds = [source_kind(s) for s in self.sources if s != "retiring"]
        return min(kinds, key=_SOURCE_ORDER.index, default=source_kind(self.came_from))

    def status(self) -> dict[str, Any]:
        """What /healthcheck and the admin API say of this instance."""
        return {
            "url": self.url,
            "rank": self.rank,
            "source": self.source,
            "discovered_by": sorted(
                s for s in self.sources if s not in ("static", "admin", "retiring")
            ),
            "state": self.state.value,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "max_in_flight": self.slots,
            "fleet_cap": None
            if self.fleet_cap is None
            else {"held": self.fleet_cap.lowest, "highest": self.fleet_cap.highest},
            "failures": self.failures,
            "last_error": self.last_error,
            "load": self.load or None,
            "models": None if self.models is None else sorted(self.models),
            "not_serving": self.not_serving,
        }

    def health(self) -> dict[str, Any]:
        """What a supervisor tells its workers of this instance."""
        return {
            "pool": self.role,
            "url": self.url,
            "state": self.state.value,
            "failures": self.failures,
            "successes": self.successes,
            "retry_at": self.retry_at,
            "last_error": self.last_error,
            "load": self.load,
            "models": self.models,
            "recompute": [self.recompute, self.recompute_episodes],
        }


#: Where instances come from, the one an instance listed by several shows first.
_SOURCE_ORDER = ("static", "admin", "dns", "dnssrv", "kubernetes")


def source_kind(source: str) -> str:
    """``static``, ``admin``, ``dns``, ``dnssrv`` or ``kubernetes``, from a source's name."""
    if source in ("static", "admin"):
        return source
    if source.startswith("kubernetes:"):
        return "kubernetes"
    return source.split("+", 1)[0]
