"""``BackendService``: the service the tree owns for the backends.

Both pools, the active health checks (``GET /health`` on every instance
each ``--health-interval``, the first round as the service starts) and the
HTTP clients, whose pooled connections are closed when the service stops.
Health checks have a client of their own, whose one connection per instance
outlives the interval, so that a check does not open a connection each time.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, TimeoutError, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from nixl_twisted.backends import routing
from nixl_twisted.backends.health import Thresholds
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.kv_events import KvEvents, PoolEvents
from nixl_twisted.backends.load import vllm_load
from nixl_twisted.backends.models import (
    name_instances,
    named_by_instance,
    read_models,
    said_models,
)
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.upstream import Upstream, read_body
from nixl_twisted.config import (
    Disaggregation,
    DiscoveryConfig,
    Health,
    KvEventsConfig,
    ModelPools,
    Policies,
    Pools,
    ProxyConfig,
)
from nixl_twisted.events import Happened
from nixl_twisted.protocol.headers import for_rank

log = Logger()


class BackendService(Service):
    """The prefill and decode pools, their health checks, and the HTTP client."""

    name = "backends"

    def __init__(
        self,
        prefill: BackendPool,
        decode: BackendPool,
        upstream: Upstream,
        clock: IReactorTime,
        health: Health,
        health_client: Upstream | None = None,
        runs_checks: bool = True,
        reactor: Any = None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.upstream = upstream
        #: The health checks' own client (by default the legs' one).
        self.health_client = health_client if health_client is not None else upstream
        self.clock = clock
        #: False in a --workers worker: the supervisor checks, and tells it.
        self.runs_checks = runs_checks
        self.health_interval = health.interval if runs_checks else 0.0
        self.health_timeout = health.timeout
        self._checks: LoopingCall | None = None
        self._probes: set[Deferred[None]] = set()
        self._first_round = Happened()
        #: Each discovery source's state (``discovery.Membership.status``), as last told.
        self.sources: list[dict[str, Any]] = []
        #: Discovery's failures by pool and kind (``discovery.Membership.counted``).
        self.discovery_errors: list[dict[str, Any]] = []
        #: The models ``[models.NAME]`` lists each member under, by pool role and by
        #: instance URL or discovery source (``Pools.named``).
        self._named: dict[str, dict[str, frozenset[str]]] = {}
        #: Sent with the health checks' ``GET /v1/models`` (vLLM's --api-key guards it).
        self.backend_api_key: str | None = None
        #: vLLM's KV events per instance, for kv-aware (a child service of the root's).
        self.kv_events = KvEvents(
            reactor if reactor is not None else clock, clock, self.pools, 131_072
        )

    def pools(self) -> tuple[BackendPool, BackendPool]:
        return (self.prefill, self.decode)

    def pool(self, role: str) -> BackendPool | None:
        return {pool.role: pool for pool in self.pools()}.get(role)

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
        if self.running and self.runs_checks and self.health_interval > 0:
            for instance in joined:
                self._check(pool, instance)

    def use_policies(
        self,
        policies: Policies,
        rules: Disaggregation | None = None,
        models: tuple[ModelPools, ...] = (),
    ) -> None:
        """Each pool chooses its instances by its policy (a model's own, for its requests).

        The health checks read vLLM's load for the ``load`` policy, and the
        prefill pool's for the busy-prefill rule (``rules.busy_prompt``).
        """
        busy_rule = rules is not None and rules.busy_prompt > 0
        busy_rule = busy_rule or any(m.setting("decode-only-busy-below", 0) for m in models)
        for pool in self.pools():
            name = policies.of(pool.role)
            key = f"{pool.role}-policy"
            own = {m.name: m.setting(key, name) for m in models if key in dict(m.own)}
            used = {name, *own.values()}
            remembers = bool(used & {"cache-aware", "kv-aware"})  # (kv-aware falls back to it)
            pool.sent.resize(policies.entries if remembers else 0)
            made = {
                named: routing.policy(
                    named, policies.balance, pool.sent, policies.min_match, self.kv_events
                )
                for named in used
            }
            pool.policy = made[name]
            pool.policy_name = name
            pool.model_policies = {model: (named, made[named]) for model, named in own.items()}
            pool.reads_load = "load" in used or (busy_rule and pool is self.prefill)
            if not pool.reads_load:
                for instance in pool.instances:
                    instance.load = {}  # no longer read: not shown as if it were current

    def use_kv_events(self, config: KvEventsConfig) -> None:
        """Where each pool's instances publish their KV events, and the index bound."""
        defaults = {pool.role: PoolEvents(*config.ports(pool.role)) for pool in self.pools()}
        self.kv_events.configure(defaults, config.max_blocks)

    def use_pools(self, pools: Pools, discovery: DiscoveryConfig) -> None:
        """Make each pool these URLs: the new join, those no longer listed drain.

        A pool with a DNS name or a selector may be left with none given:
        discovery fills it.
        """
        for pool in self.pools():
            pool.discovers = bool(pools.names(pool.role) or discovery.selector(pool.role))
            pool.update(pools.static(pool.role))
        self.use_models(pools)

    def use_models(self, pools: Pools) -> None:
        """Which models ``[models.NAME]`` lists each instance under, from now on."""
        for pool in self.pools():
            self._named[pool.role] = named_by_instance(pools.named(pool.role))
            self._name(pool)

    def _name(self, pool: BackendPool) -> None:
        """The pool's instances named by ``[models.NAME]`` as last configured."""
        name_instances(pool.instances, self._named.get(pool.role, {}))

    def configure(self, config: ProxyConfig) -> None:
        """A reload: pools, policies, health rules and idle connections as ``config`` says.

        New instances join (checked first), those no longer listed drain; a
        new health interval takes effect at once, its first round now.
        """
        self.use_pools(config.pools, config.discovery)
        self.use_kv_events(config.kv_events)
        self.use_policies(config.policies, config.disaggregation, config.pools.models)
        self.backend_api_key = config.backend_api_key
        health = config.health
        thresholds = Thresholds.of(health)
        for pool in self.pools():
            pool.configure(thresholds, checked=health.interval > 0)
        self.health_timeout = health.timeout
        self.upstream.keep_idle(config.limits.max_idle_per_backend, config.timeouts.backend_idle)
        interval = health.interval if self.runs_checks else 0.0
        if interval != self.health_interval:
            self.health_interval = interval
            self._stop_checks()
            if self.running:
                self._start_checks()

    def status(self, instance: Instance) -> dict[str, Any]:
        """What /healthcheck and the admin listing say of an instance, its KV events included."""
        said = instance.status()
        said["kv_events"] = self.kv_events.status(instance.role, instance.url)
        return said

    def ready(self) -> bool:
        """Both pools have an instance that is up now."""
        return all(pool.ready() for pool in self.pools())

    def startService(self) -> None:
        super().startService()
        self._start_checks()

    def _start_checks(self) -> None:
        if self.health_interval <= 0:
            self._first_round.fire()  # nothing to wait for
            return
        self._checks = LoopingCall(self.check_health)
        self._checks.clock = self.clock
        # The first round now: until it answers, /healthcheck says not ready.
        self.check_health().addCallback(lambda _: self._first_round.fire())
        self._checks.start(self.health_interval, now=False).addErrback(
            lambda failure: log.failure("health checks stopped", failure)
        )

    def _stop_checks(self) -> None:
        if self._checks is not None and self._checks.running:
            self._checks.stop()
        self._checks = None

    def first_round(self) -> Deferred[None]:
        """Fires once the first round of health checks has answered (or failed)."""
        return self._first_round.wait()

    def check_health(self) -> Deferred[Any]:
        """``GET /health`` on every instance; never fails (the loop must not die)."""
        checks = [
            self._check(pool, instance)
            for pool in self.pools()
            for instance in list(pool.instances)
        ]
        return DeferredList(checks, consumeErrors=True)

    def _check(self, pool: BackendPool, instance: Instance) -> Deferred[None]:
        async def probe() -> None:
            checking = for_rank(Headers(), instance.rank)
            response = await self.health_client.get(instance.base + "/health", checking)
            await read_body(response)
            if response.code != 200:
                raise RuntimeError(f"GET /health answered HTTP {response.code}")
            if pool.reads_load:
                await self._scrape(pool, instance)

        checking = ensureDeferred(probe()).addTimeout(self.health_timeout, self.clock)
        self._probes.add(checking)

        def done(result: object) -> object:
            self._probes.discard(checking)
            return result

        def failed(failure: Failure) -> None:
            if not self.running:
                return  # cancelled by stopService
            reason = "timed out" if failure.check(TimeoutError) else failure.getErrorMessage()
            pool.record_failure(instance, f"health check failed: {reason}")

        def succeeded(_: object) -> Deferred[None]:
            # What it serves is read before it is judged up (a pending instance then
            # takes only its models' legs), under a timeout of its own: a slow or
            # failing /v1/models keeps the last list, and never fails the check.
            return self._read(pool, instance).addCallback(lambda _: pool.record_success(instance))

        checking.addBoth(done)
        checking.addCallbacks(succeeded, failed)
        checking.addErrback(lambda failure: log.failure("health check error", failure))
        return checking

    def _read(self, pool: BackendPool, instance: Instance) -> Deferred[None]:
        """``_read_models`` within ``--health-timeout``; never fails."""
        reading = ensureDeferred(self._read_models(pool, instance))
        reading.addTimeout(self.health_timeout, self.clock)
        self._probes.add(reading)

        def done(result: object) -> None:
            self._probes.discard(reading)
            if isinstance(result, Failure) and self.running:
                log.debug(
                    "models of {url} not read: {why}", url=instance.url, why=str(result.value)
                )

        return reading.addBoth(done)

    async def _read_models(self, pool: BackendPool, instance: Instance) -> None:
        """What the instance serves, from its ``/v1/models``; unreadable: the last known kept.

        The workers are told of a change, as of one in health.
        """
        asking = for_rank(Headers(), instance.rank)
        if self.backend_api_key is not None:
            asking.setRawHeaders(b"authorization", [f"Bearer {self.backend_api_key}".encode()])
        try:
            response = await self.health_client.get(instance.base + "/v1/models", asking)
            body = await read_body(response)
            if response.code != 200:
                raise ValueError(f"GET /v1/models answered HTTP {response.code}")
            models = read_models(body)
        except Exception as error:
            if instance.models is None:
                log.debug("no models from {url}: {error}", url=instance.url, error=str(error))
            else:
                log.warn(
                    "{url} could not say its models ({error}): its last list is kept",
                    url=instance.url,
                    error=str(error),
                )
            return
        if said_models(instance, models):
            pool.load_changed(instance)

    async def _scrape(self, pool: BackendPool, instance: Instance) -> None:
        """vLLM's own load from its ``/metrics``; unreadable: the policy falls back, no mark."""
        ours = instance.in_flight
        try:
            response = await self.health_client.get(instance.base + "/metrics", Headers())
            text = (await read_body(response)).decode("utf-8", "replace")
        except Exception as error:
            instance.load = {}
            log.debug("no load from {url}: {error}", url=instance.url, error=str(error))
            return
        instance.load = vllm_load(text) if response.code == 200 else {}
        if instance.load:
            instance.load["ours"] = float(ours)
        pool.load_changed(instance)

    def stopService(self) -> Deferred[None]:
        """Stop the health checks and close every pooled backend connection."""
        super().stopService()
        self._stop_checks()
        for probe in list(self._probes):
            probe.cancel()
        closing = [self.upstream.close()]
        if self.health_client is not self.upstream:
            closing.append(self.health_client.close())
        return DeferredList(closing).addCallback(lambda _: None)
