"""``BackendService``: both pools and the HTTP client their legs go out on.

The one place the pools are changed: by the configuration (``configure``,
at start and at each reload), by discovery and the admin API
(``discovered``, ``apply_change``), and by the workers' coordination.
Instances that join are handed to the health checks (``checks.HealthChecks``)
at once. The legs' pooled connections are closed when the service stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from twisted.application.service import Service
from twisted.internet.defer import Deferred

from nixl_twisted.backends import policies as registry
from nixl_twisted.backends import routing
from nixl_twisted.backends.capacity import Caps
from nixl_twisted.backends.health import Thresholds
from nixl_twisted.backends.holdings import NO_HOLDINGS, Holdings
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.models import name_instances, named_by_instance
from nixl_twisted.backends.policies import Needs
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.upstream import Upstream
from nixl_twisted.config import Disaggregation, ModelPools, Policies, Pools, ProxyConfig


class Joined(Protocol):
    """Told of the instances that join a pool (``HealthChecks``: checked at once)."""

    def joined(self, pool: BackendPool, instances: Sequence[Instance]) -> None: ...


class _NobodyChecks:
    def joined(self, pool: BackendPool, instances: Sequence[Instance]) -> None:
        """No health checks to tell."""


class BackendService(Service):
    """The prefill and decode pools, and the HTTP client of their legs."""

    name = "backends"

    def __init__(
        self,
        prefill: BackendPool,
        decode: BackendPool,
        upstream: Upstream,
        config: ProxyConfig,
        checks: Joined | None = None,
        holdings: Holdings = NO_HOLDINGS,
    ) -> None:
        """``checks``: told of each instance that joins; ``holdings``: what vLLM's KV
        events say each instance holds (``kv-aware``'s)."""
        self.prefill = prefill
        self.decode = decode
        self.upstream = upstream
        self.checks: Joined = checks if checks is not None else _NobodyChecks()
        self.holdings = holdings
        #: The models ``[models.NAME]`` lists each member under, by pool role and by
        #: instance URL or discovery source (``Pools.named``).
        self._named: dict[str, dict[str, frozenset[str]]] = {}
        #: What the policies read, for requests of each model that has its own (``needs``).
        self._needs: dict[str, Needs] = {}
        self._needs_any = registry.NOTHING
        self.configure(config)

    def pools(self) -> tuple[BackendPool, BackendPool]:
        return (self.prefill, self.decode)

    def pool(self, role: str) -> BackendPool | None:
        return {pool.role: pool for pool in self.pools()}.get(role)

    def configure(self, config: ProxyConfig) -> None:
        """Pools, policies, health rules and idle connections as ``config`` says.

        New instances join (checked first), those no longer listed drain.
        """
        self.use_pools(config)
        self.use_policies(config.policies, config.disaggregation, config.pools.models)
        self.use_caps(config)
        health = config.health
        thresholds = Thresholds.of(health)
        for pool in self.pools():
            pool.configure(thresholds, checked=health.interval > 0)
        self.upstream.keep_idle(config.limits.max_idle_per_backend, config.timeouts.backend_idle)

    def apply_change(self, change: dict[str, str]) -> list[Instance]:
        """Add, drain or remove an instance (``{"op", "pool", "url"}``); [] if it is unknown.

        The admin API and the workers' coordination both change the pools
        here. A ``URL#dp=N`` names each of its ranks. Raises
        ``PoolChangeRefused`` for a change that would empty a pool.
        """
        pool = self.pool(change["pool"])
        if pool is None:
            return []
        if change["op"] == "add":
            added = pool.add(change["url"])
            self._name(pool)  # (a [models.NAME] member added back)
            return added
        if change["op"] == "drain":
            return pool.drain(change["url"])
        return pool.remove(change["url"])

    def discovered(
        self, role: str, source: str, urls: tuple[str, ...], retire: bool = False
    ) -> None:
        """What a discovery source lists now: the new join (checked first), the vanished drain.

        ``retire``: the source is no longer configured (``BackendPool.discovered``).
        """
        pool = self.pool(role)
        if pool is None:
            return
        joined, _ = pool.discovered(source, urls, retire)
        self._name(pool)
        if joined:
            self.checks.joined(pool, joined)

    def use_policies(
        self,
        policies: Policies,
        rules: Disaggregation | None = None,
        models: tuple[ModelPools, ...] = (),
    ) -> None:
        """Each pool chooses its instances by its policy (a model's own, for its requests).

        What the policies read (``policies.Needs``) says what is read of the
        instances: vLLM's load (also the prefill pool's for the busy-prefill
        rule, ``rules.busy_prompt``), the KV events, the memory of prefixes sent.
        """
        busy_rule = rules is not None and rules.busy_prompt > 0
        busy_rule = busy_rule or any(m.setting("decode-only-busy-below", 0) for m in models)
        balance = routing.Balance(policies.balance, policies.margin)
        for pool in self.pools():
            name = policies.of(pool.role)
            key = f"{pool.role}-policy"
            own = {m.name: m.setting(key, name) for m in models if key in dict(m.own)}
            remembers = registry.needs({name, *own.values()}).sent_prefixes
            pool.sent.resize(policies.entries if remembers else 0)
            parts = registry.Parts(balance, pool.sent, policies.min_match, self.holdings)
            chosen = registry.chosen(name, parts, own)
            pool.use_policies(chosen, policies.warm_up, busy_rule and pool is self.prefill)
        # What a request's routing reads, by the model it names (any other: the pools' own).
        prefill, decode = self.prefill, self.decode
        self._needs_any = prefill.policy_for(None).needs | decode.policy_for(None).needs
        self._needs = {
            model: prefill.policy_for(model).needs | decode.policy_for(model).needs
            for model in {*prefill.policies.by_model, *decode.policies.by_model}
        }

    def needs(self, model: str | None) -> Needs:
        """What the policies choosing ``model``'s instances read, in both pools together."""
        if model is None:
            return self._needs_any
        return self._needs.get(model, self._needs_any)

    def use_caps(self, config: ProxyConfig) -> None:
        """Each instance's cap (its own, its model's, its pool's) and this process's share."""
        capacity = config.capacity
        defaults = {
            "prefill": capacity.prefill_max_in_flight,
            "decode": capacity.decode_max_in_flight,
        }
        worker = config.worker if config.worker is not None else 0
        for pool in self.pools():
            key = f"{pool.role}-max-in-flight"
            by_model = {
                m.name: m.setting(key, 0) for m in config.pools.models if key in dict(m.own)
            }
            # Shared through --replicas-redis, a cap is the fleet's: no static split.
            workers = 1 if config.replicas.redis is not None else config.worker_count
            pool.use_caps(Caps(defaults[pool.role], by_model, worker % workers, workers))

    def capped(self) -> bool:
        """Whether any instance has a cap: else no leg ever waits for room."""
        return self.prefill.capped or self.decode.capped

    def use_pools(self, config: ProxyConfig) -> None:
        """Make each pool these URLs: the new join, those no longer listed drain.

        A pool with a DNS name or a selector may be left with none given:
        discovery fills it.
        """
        pools, found = config.pools, config.discovery
        for pool in self.pools():
            pool.discovers = bool(pools.names(pool.role) or found.selector(pool.role))
            pool.update(pools.static(pool.role))
        self.use_models(pools)

    def use_models(self, pools: Pools) -> None:
        """Which models ``[models.NAME]`` lists each instance under, from now on."""
        for pool in self.pools():
            self._named[pool.role] = named_by_instance(pools.named(pool.role))
            self._name(pool)

    def _name(self, pool: BackendPool) -> None:
        """The pool's instances named by ``[models.NAME]`` as last configured (and so their
        model's cap)."""
        name_instances(pool.instances, self._named.get(pool.role, {}))
        if pool.caps.by_model:
            pool.use_caps(pool.caps)

    def ready(self) -> bool:
        """Both pools have an instance that is up now."""
        return all(pool.ready() for pool in self.pools())

    def stopService(self) -> Deferred[Any]:
        """Close every pooled backend connection."""
        super().stopService()
        return self.upstream.close()
