"""``Discovery``: the service that runs the sources and applies what they find.

It matches the running sources to the configuration at start and at each
reload (a source no longer configured stops, and its instances drain), and
hands each change to the backends as a reload would (``BackendService.discovered``:
the new are checked before they take legs, the vanished drain). Under
``--workers`` only the supervisor runs it, and tells the workers
(``Followers``). What it says of its sources is read from it
(``report.Reported``), never copied into another's attributes.
"""

from __future__ import annotations

from typing import Any, Protocol

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.discovery.membership import Membership

log = Logger()


class Source(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class Followers(Protocol):
    """Who else applies what discovery finds (a ``--workers`` supervisor's workers)."""

    def discovered(self, role: str, source: str, urls: tuple[str, ...], retire: bool) -> None:
        """A source lists ``urls`` now (applied here already)."""

    def sources(self, status: list[dict[str, Any]], errors: list[dict[str, Any]]) -> None:
        """The sources' states changed (``Discovery.sources``, ``Discovery.errors``)."""


class Discovery(Service):
    """Every ``dns+``/``dnssrv+`` member and Kubernetes selector, found and applied."""

    name = "discovery"

    def __init__(
        self,
        reactor: Any,
        clock: IReactorTime,
        backends: BackendService,
        config: ProxyConfig,
        followers: Followers | None = None,
    ) -> None:
        self.reactor = reactor
        self.clock = clock
        self.backends = backends
        self.followers = followers
        self.membership = Membership(clock, self._apply, on_status=self._status_changed)
        self._sources: dict[tuple[Any, ...], tuple[str, str, Source]] = {}
        self._config: ProxyConfig | None = None
        self._resolver: Any = None
        self._dns_server: str | None = None
        self._changed: list[Deferred[None]] = []
        self._noticed: list[Deferred[None]] = []
        self.configure(config)

    def sources(self) -> list[dict[str, Any]]:
        """Each source's state now (``/healthcheck``)."""
        return self.membership.status()

    def errors(self) -> list[dict[str, Any]]:
        """The failures since start, by pool and kind (``nixlproxy_discovery_errors_total``)."""
        return self.membership.counted()

    def configure(self, config: ProxyConfig) -> None:
        """The sources ``config`` names run from now on; the others stop (theirs drain)."""
        self._config = config
        found = config.discovery
        self.membership.grace = found.grace
        if found.max_instances != self.membership.most:
            self.membership.use_most(found.max_instances)
        allowed = AllowedBackends(found.allowed)
        if allowed.entries != self.membership.allowed.entries:
            self.membership.use_allowed(allowed)
        if self.running:
            self._reconcile()

    def _wanted(self) -> dict[tuple[Any, ...], tuple[str, str]]:
        assert self._config is not None
        config, found = self._config, self._config.discovery
        wanted: dict[tuple[Any, ...], tuple[str, str]] = {}
        refresh = (found.dns_min_refresh, found.dns_max_refresh)
        for role in ("prefill", "decode"):
            for member in config.pools.names(role):
                wanted[("dns", role, member, found.dns_server, refresh)] = (role, member)
            selector = found.selector(role)
            if selector is not None:
                from nixl_twisted.discovery.kubernetes import source_name

                key = ("kubernetes", role, selector, found.namespace, found.port, found.kubeconfig)
                wanted[key] = (role, source_name(found, selector))
        return wanted

    def _reconcile(self) -> None:
        wanted = self._wanted()
        still = set(wanted.values())
        for key in [k for k in self._sources if k not in wanted]:
            role, source, running = self._sources.pop(key)
            running.stop()
            if (role, source) not in still:  # (else it only resolves differently now)
                self.membership.forget(role, source)
        for key, (role, source) in wanted.items():
            if key not in self._sources:
                made = self._make(key, role, source)
                self._sources[key] = (role, source, made)
                made.start()

    def _make(self, key: tuple[Any, ...], role: str, source: str) -> Source:
        assert self._config is not None
        # Twisted Names, PyYAML and the sources load only when a source is configured.
        from nixl_twisted.discovery import dns
        from nixl_twisted.discovery.kubernetes import KubernetesSource

        found = self._config.discovery
        if key[0] == "dns":
            return dns.DnsSource(
                role,
                source,
                self._dns_resolver(found.dns_server),
                self.clock,
                self.membership,
                (found.dns_min_refresh, found.dns_max_refresh),
            )
        return KubernetesSource(role, source, found, self.reactor, self.clock, self.membership)

    def _dns_resolver(self, server: str | None) -> Any:
        from nixl_twisted.discovery import dns

        if self._resolver is None or server != self._dns_server:
            if self._resolver is not None:
                dns.close(self._resolver)
            self._resolver = dns.resolver(server, self.reactor, self.clock)
            self._dns_server = server
        return self._resolver

    def _apply(self, role: str, source: str, urls: tuple[str, ...], retire: bool) -> None:
        self.backends.discovered(role, source, urls, retire)
        if self.followers is not None:
            self.followers.discovered(role, source, urls, retire)
        waiting, self._changed = self._changed, []
        for each in waiting:
            each.callback(None)

    def _status_changed(self) -> None:
        if self.followers is not None:
            self.followers.sources(self.sources(), self.errors())
        waiting, self._noticed = self._noticed, []
        for each in waiting:
            each.callback(None)

    def changed(self) -> Deferred[None]:
        """Fires after the next change is applied to the pools (what tests wait on)."""
        waiting: Deferred[None] = Deferred()
        self._changed.append(waiting)
        return waiting

    def noticed(self) -> Deferred[None]:
        """Fires after any source's state next changes (an error counted, a grace begun)."""
        waiting: Deferred[None] = Deferred()
        self._noticed.append(waiting)
        return waiting

    def startService(self) -> None:
        super().startService()
        if self._config is not None:
            self._reconcile()

    def stopService(self) -> None:
        super().stopService()
        for _, _, running in self._sources.values():
            running.stop()
        self._sources.clear()
        self.membership.stop()
        if self._resolver is not None:
            from nixl_twisted.discovery import dns

            dns.close(self._resolver)
            self._resolver = None
