"""``HealthChecks``: every instance asked how it is, each ``--health-interval``.

``GET /health`` on every instance of both pools (the first round as the
service starts: until it answers, the proxy is not ready), then what it
serves (``GET /v1/models``, under a timeout of its own) and vLLM's own
counters (``GET /metrics``): its load, for a pool whose policy or rules read
it, and every instance's KV transfers (``backends.recompute``). The checks
have an HTTP client of their own, whose one connection per instance
outlives the interval, so that a check does not open a connection each
time. In a ``--workers`` worker none run: the supervisor checks for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, TimeoutError, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.load import vllm_load
from nixl_twisted.backends.models import read_models, said_models
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.recompute import Transfers
from nixl_twisted.backends.upstream import Upstream, read_body
from nixl_twisted.config import ProxyConfig
from nixl_twisted.happened import Happened
from nixl_twisted.protocol.headers import for_rank

log = Logger()


class HealthChecks(Service):
    """The health loop over ``pools``, and the reads of what each instance serves and its load."""

    name = "health-checks"

    def __init__(
        self,
        pools: Sequence[BackendPool],
        client: Upstream,
        clock: IReactorTime,
        config: ProxyConfig,
        runs: bool = True,
    ) -> None:
        """``runs`` False: none here (a worker: its supervisor checks, and tells it)."""
        self.pools = tuple(pools)
        self.client = client
        self.clock = clock
        self.runs = runs
        self.interval = 0.0
        self._loop: LoopingCall | None = None
        self._probes: set[Deferred[None]] = set()
        self._first_round = Happened()
        #: What decode computed itself of the P/D legs' prompts, and the NIXL failures.
        self.transfers = Transfers()
        self.configure(config)

    def configure(self, config: ProxyConfig) -> None:
        """The interval and timeout from now on (a new interval: its first round at once),
        and the key the ``/v1/models`` reads send (vLLM's ``--api-key`` guards it)."""
        health = config.health
        self.timeout = health.timeout
        self.backend_api_key = config.backend_api_key
        interval = health.interval if self.runs else 0.0
        if interval != self.interval:
            self.interval = interval
            self._stop_loop()
            if self.running:
                self._start_loop()

    def startService(self) -> None:
        super().startService()
        self._start_loop()

    def stopService(self) -> Deferred[None]:
        """Stop the loop and every check out, and close the checks' connections."""
        super().stopService()
        self._stop_loop()
        for probe in list(self._probes):
            probe.cancel()
        return self.client.close()

    def first_round(self) -> Deferred[None]:
        """Fires once the first round of health checks has answered (or failed)."""
        return self._first_round.wait()

    def joined(self, pool: BackendPool, instances: Sequence[Instance]) -> None:
        """New instances (discovered, added) are checked at once, not at the next round."""
        if self.running and self.interval > 0:
            for instance in instances:
                self._check(pool, instance)

    def check_health(self) -> Deferred[Any]:
        """``GET /health`` on every instance; never fails (the loop must not die)."""
        self.transfers.keep(instance for pool in self.pools for instance in pool.instances)
        checks = [
            self._check(pool, instance) for pool in self.pools for instance in list(pool.instances)
        ]
        return DeferredList(checks, consumeErrors=True)

    def _start_loop(self) -> None:
        if self.interval <= 0:
            self._first_round.fire()  # nothing to wait for
            return
        self._loop = LoopingCall(self.check_health)
        self._loop.clock = self.clock
        # The first round now: until it answers, /healthcheck says not ready.
        self.check_health().addCallback(lambda _: self._first_round.fire())
        self._loop.start(self.interval, now=False).addErrback(
            lambda failure: log.failure("health checks stopped", failure)
        )

    def _stop_loop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def _check(self, pool: BackendPool, instance: Instance) -> Deferred[None]:
        async def probe() -> None:
            checking = for_rank(Headers(), instance.rank)
            response = await self.client.get(instance.base + "/health", checking)
            await read_body(response)
            if response.code != 200:
                raise RuntimeError(f"GET /health answered HTTP {response.code}")
            await self._scrape(pool, instance)

        checking = ensureDeferred(probe()).addTimeout(self.timeout, self.clock)
        self._probes.add(checking)

        def done(result: object) -> object:
            self._probes.discard(checking)
            return result

        def failed(failure: Failure) -> None:
            if not self.running:
                return  # cancelled by stopService
            reason = "timed out" if failure.check(TimeoutError) else failure.getErrorMessage()
            pool.record_failure(instance, f"health check failed: {reason}", leg=False)

        def succeeded(_: object) -> Deferred[None]:
            # What it serves is read before it is judged up (a pending instance then
            # takes only its models' legs), under a timeout of its own: a slow or
            # failing /v1/models keeps the last list, and never fails the check.
            return self._read(pool, instance).addCallback(
                lambda _: pool.record_success(instance, leg=False)
            )

        checking.addBoth(done)
        checking.addCallbacks(succeeded, failed)
        checking.addErrback(lambda failure: log.failure("health check error", failure))
        return checking

    def _read(self, pool: BackendPool, instance: Instance) -> Deferred[None]:
        """``_read_models`` within ``--health-timeout``; never fails."""
        reading = ensureDeferred(self._read_models(pool, instance))
        reading.addTimeout(self.timeout, self.clock)
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
            response = await self.client.get(instance.base + "/v1/models", asking)
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
        """vLLM's own load and KV transfers from its ``/metrics``; unreadable: the policy
        falls back, the transfers are not judged, no mark."""
        ours = instance.in_flight
        try:
            response = await self.client.get(instance.base + "/metrics", Headers())
            text = (await read_body(response)).decode("utf-8", "replace")
        except Exception as error:
            if pool.reads_load:
                instance.load = {}
            log.debug("no metrics from {url}: {error}", url=instance.url, error=str(error))
            return
        shown = response.code == 200 and self.transfers.scraped(
            instance, text, self.clock.seconds()
        )
        if pool.reads_load:
            instance.load = vllm_load(text) if response.code == 200 else {}
            if instance.load:
                instance.load["ours"] = float(ours)
        if pool.reads_load or shown:
            pool.load_changed(instance)
