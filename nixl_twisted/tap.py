"""``twistd nixlproxy``: the options and the service tree they build.

The tree is a ``ProxyService`` holding the ``BackendService`` (pools,
health checks, the pooled HTTP client) and one ``ListenService`` per
``--listen`` endpoint, all serving one site.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, cast

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, TimeoutError, maybeDeferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IReactorTime, IStreamServerEndpoint
from twisted.logger import ILogObserver, Logger, jsonFileLogObserver
from twisted.python import usage
from twisted.python.failure import Failure

from nixl_twisted import identity
from nixl_twisted.access import AccessLog
from nixl_twisted.admin import ADMIN_TOKEN_ENV
from nixl_twisted.app import DEFAULT_MAX_IN_FLIGHT, ProxyApp
from nixl_twisted.config import config_path, file_arguments, pools_from_file
from nixl_twisted.events import Happened
from nixl_twisted.exchange import Limits
from nixl_twisted.metrics import MetricsResource, ProxyMetrics
from nixl_twisted.pools import (
    DEFAULT_HEALTH_INTERVAL,
    DEFAULT_HEALTH_TIMEOUT,
    BackendPool,
    BackendService,
    InvalidBackendURL,
)
from nixl_twisted.site import DEFAULT_MAX_BODY_SIZE, TrackingSite
from nixl_twisted.upstream import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_IDLE_PER_INSTANCE,
    Upstream,
)
from nixl_twisted.workers import (
    ReusePortEndpoint,
    WorkerSupervisor,
    reserve,
    take_sigterm,
    tcp_address,
    worker_args,
)

log = Logger()

#: The environment variable that holds the backend API key, so that the key
#: need not appear in a process listing.
BACKEND_API_KEY_ENV = "NIXLPROXY_BACKEND_API_KEY"
DEFAULT_DRAIN_TIMEOUT = 30.0
#: Seconds drained connections get to send what they have buffered.
CLOSE_GRACE = 5.0


def _positive_float(name: str) -> Any:
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--{name} must be a number of seconds, not {value!r}") from None
        if not number > 0:
            raise ValueError(f"--{name} must be greater than 0, not {value!r}")
        return number

    return parse


def _seconds_or_off(name: str) -> Any:
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--{name} must be a number of seconds, not {value!r}") from None
        if number < 0:
            raise ValueError(f"--{name} must be 0 (off) or more, not {value!r}")
        return number

    return parse


def _whole(name: str, least: int = 1) -> Any:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"--{name} must be a whole number, not {value!r}") from None
        if number < least:
            raise ValueError(f"--{name} must be at least {least}, not {value!r}")
        return number

    return parse


def _choice(name: str, choices: tuple[str, ...]) -> Any:
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError(f"--{name} must be one of {', '.join(choices)}, not {value!r}")
        return value

    return parse


def _positive_int(name: str) -> Any:
    return _whole(name, 1)


class Options(usage.Options):
    """Command-line options of ``twistd nixlproxy``."""

    synopsis = "[options] --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]"
    longdesc = (
        "A proxy for vLLM disaggregated serving: each completion is sent, "
        "lowered, to a prefill instance, then with the prefill's "
        "kv_transfer_params to a decode instance whose answer is streamed back. "
        f"Identity: {identity.ID} version {identity.VERSION}. The backend API key "
        f"may also be given in the {BACKEND_API_KEY_ENV} environment variable."
    )

    optFlags: list[Any] = [
        ["reuse-port", None, "Listen with SO_REUSEPORT (how --workers start their workers)."],
    ]

    optParameters: list[Any] = [
        [
            "backend-api-key",
            None,
            None,
            "API key sent to the backends as 'Authorization: Bearer KEY' when the "
            f"client sent no Authorization (default: ${BACKEND_API_KEY_ENV}).",
        ],
        [
            "connect-timeout",
            None,
            DEFAULT_CONNECT_TIMEOUT,
            "Seconds to wait for a TCP connection to a backend.",
            _positive_float("connect-timeout"),
        ],
        [
            "backend-idle-timeout",
            None,
            DEFAULT_IDLE_TIMEOUT,
            "Seconds an idle backend connection is kept for reuse; keep it below "
            "vLLM's 5 s keep-alive.",
            _positive_float("backend-idle-timeout"),
        ],
        [
            "max-idle-per-backend",
            None,
            DEFAULT_MAX_IDLE_PER_INSTANCE,
            "Idle keep-alive connections kept per backend instance.",
            _positive_int("max-idle-per-backend"),
        ],
        [
            "prefill-timeout",
            None,
            Limits.prefill_timeout,
            "Seconds to wait for a prefill instance's whole answer (504 after).",
            _positive_float("prefill-timeout"),
        ],
        [
            "decode-timeout",
            None,
            Limits.decode_timeout,
            "Seconds to wait for a decode instance's response headers; a "
            "non-streaming answer sends them when generation ends (504 after).",
            _positive_float("decode-timeout"),
        ],
        [
            "stream-idle-timeout",
            None,
            Limits.stream_idle_timeout,
            "Seconds of silence allowed between two chunks of a decode body; a "
            "long generation that keeps producing tokens is never cut.",
            _positive_float("stream-idle-timeout"),
        ],
        [
            "prefill-retries",
            None,
            Limits.prefill_retries,
            "Other prefill instances tried when one cannot be reached or answers 502, 503 or 504.",
            _whole("prefill-retries", 0),
        ],
        [
            "decode-retries",
            None,
            Limits.decode_retries,
            "Other decode instances tried, with the same kv_transfer_params, when "
            "one cannot be reached.",
            _whole("decode-retries", 0),
        ],
        [
            "health-interval",
            None,
            DEFAULT_HEALTH_INTERVAL,
            "Seconds between GET /health checks of every instance (0: off).",
            _seconds_or_off("health-interval"),
        ],
        [
            "health-timeout",
            None,
            DEFAULT_HEALTH_TIMEOUT,
            "Seconds a health check may take before it counts as failed.",
            _positive_float("health-timeout"),
        ],
        [
            "max-in-flight",
            None,
            DEFAULT_MAX_IN_FLIGHT,
            "Requests served at once; past it, 503 with Retry-After at once.",
            _positive_int("max-in-flight"),
        ],
        [
            "max-body-size",
            None,
            DEFAULT_MAX_BODY_SIZE,
            "Largest request body in bytes (413 past it; vLLM's default too).",
            _positive_int("max-body-size"),
        ],
        [
            "admin-token",
            None,
            None,
            "Bearer token that enables the admin API (/admin/backends); without "
            f"one there is none (default: ${ADMIN_TOKEN_ENV}).",
        ],
        [
            "metrics-listen",
            None,
            None,
            "Serve GET /metrics on this endpoint (e.g. tcp:9100:interface=127.0.0.1) "
            "instead of on every --listen endpoint.",
        ],
        [
            "workers",
            None,
            1,
            "Proxy processes sharing each TCP --listen port (SO_REUSEPORT), each "
            "with its own pools and health state, supervised by this one.",
            _positive_int("workers"),
        ],
        [
            "log-format",
            None,
            "text",
            "text (for people) or json (one JSON object per line on stdout, for log pipelines).",
            _choice("log-format", ("text", "json")),
        ],
        [
            "access-log",
            None,
            "on",
            "on: one info event per request (nixlproxy.access); off: none, "
            "the request metrics still count every request.",
            _choice("access-log", ("on", "off")),
        ],
        [
            "drain-timeout",
            None,
            DEFAULT_DRAIN_TIMEOUT,
            "On SIGTERM, seconds to let requests in flight finish before closing them.",
            _seconds_or_off("drain-timeout"),
        ],
    ]

    def parseOptions(self, options: Sequence[str] | None = None) -> None:
        """Parse, with a ``--config`` file's settings first (the command line wins)."""
        args = list(sys.argv[1:] if options is None else options)
        #: The command line as given: --workers hands it on to its workers.
        self.command_line = list(args)
        path = config_path(args)
        if path is not None:
            parameters = {p[0]: (p[4] if len(p) > 4 else None) for p in self.optParameters}
            args = file_arguments(path, args, parameters) + args
        super().parseOptions(args)

    def opt_config(self, path: str) -> None:
        """A TOML file with any of these options by their long names; the
        command line overrides it (see docs/configuration.md)."""
        self["config"] = path

    def __init__(self) -> None:
        super().__init__()
        self["config"] = None
        self["listen"] = []
        self["prefill"] = []
        self["decode"] = []

    def opt_listen(self, endpoint: str) -> None:
        """Endpoint to serve on, as a Twisted endpoint string (repeatable;
        default tcp:8000), e.g. tcp:8000:interface=127.0.0.1,
        ssl:8443:privateKey=key.pem:certKey=cert.pem, unix:/run/nixlproxy.sock."""
        self["listen"].append(endpoint)

    def opt_prefill(self, url: str) -> None:
        """Base URL of a vLLM prefill instance, e.g. http://10.0.0.1:8100
        (repeatable; at least one)."""
        self["prefill"].append(url)

    def opt_decode(self, url: str) -> None:
        """Base URL of a vLLM decode instance, e.g. http://10.0.0.2:8200
        (repeatable; at least one)."""
        self["decode"].append(url)

    def opt_version(self) -> None:
        """Print the proxy's identity and version, then exit."""
        print(f"{identity.ID} {identity.VERSION}")
        raise SystemExit(0)

    def postOptions(self) -> None:
        if not self["listen"]:
            self["listen"] = ["tcp:8000"]
        for role in ("prefill", "decode"):
            if not self[role]:
                raise usage.UsageError(
                    f"at least one --{role} URL is required (a vLLM {role} instance)"
                )
            try:
                self[f"{role}_pool"] = BackendPool(role, self[role])
            except InvalidBackendURL as error:
                raise usage.UsageError(f"--{role}: {error}") from None
        if self["backend-api-key"] is None:
            self["backend-api-key"] = os.environ.get(BACKEND_API_KEY_ENV) or None
        if self["admin-token"] is None:
            self["admin-token"] = os.environ.get(ADMIN_TOKEN_ENV) or None
        from twisted.internet import reactor

        self["endpoints"] = [_endpoint(reactor, desc) for desc in self["listen"]]
        if self["reuse-port"]:
            self["workers"] = 1  # a worker never starts workers of its own
        if self["workers"] > 1 or self["reuse-port"]:
            self["tcp_addresses"] = [tcp_address(e) for e in self["endpoints"]]
            if None in self["tcp_addresses"]:
                raise usage.UsageError(
                    "--workers and --reuse-port need every --listen to be tcp:PORT[:interface=...]"
                )
            if self["metrics-listen"]:
                raise usage.UsageError(
                    "--metrics-listen cannot be shared by several workers; "
                    "scrape /metrics on the --listen endpoint"
                )
        self["metrics_endpoint"] = (
            _endpoint(reactor, self["metrics-listen"], "--metrics-listen")
            if self["metrics-listen"]
            else None
        )


def _endpoint(reactor: Any, description: str, option: str = "--listen") -> IStreamServerEndpoint:
    try:
        return serverFromString(reactor, description)
    except (ValueError, KeyError, TypeError) as error:
        raise usage.UsageError(
            f"{option} {description!r} is not a usable endpoint: {error}"
        ) from None


class ListenService(Service):
    """Serves a site on one endpoint, and logs the address once it is bound."""

    def __init__(self, endpoint: IStreamServerEndpoint, site: TrackingSite) -> None:
        self.endpoint = endpoint
        self.site = site
        self.port: IListeningPort | None = None

    def startService(self) -> None:
        super().startService()
        synchronous: list[Failure] = []
        starting = True

        def failed(failure: Failure) -> None:
            if starting:
                synchronous.append(failure)
            else:
                self._failed(failure)

        self.endpoint.listen(self.site).addCallbacks(self._bound, failed)
        starting = False
        if synchronous:
            # Most endpoints bind synchronously: raising here makes twistd
            # report the error and exit non-zero instead of serving nothing.
            synchronous[0].raiseException()

    def _bound(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        log.info("nixlproxy listening on {address}", address=_address(port))
        return port

    def _failed(self, failure: Failure) -> None:
        log.failure("nixlproxy could not listen", failure)
        from twisted.internet import reactor

        reactor.stop()

    def stopService(self) -> Deferred[Any]:
        """Stop accepting connections (those open are the ``ProxyService``'s)."""
        super().stopService()
        if self.port is None:
            return succeed(None)
        port, self.port = self.port, None
        return maybeDeferred(port.stopListening)


def _address(port: IListeningPort) -> str:
    host = port.getHost()
    if hasattr(host, "port"):
        return f"{host.host}:{host.port}"  # type: ignore[attr-defined]
    name = getattr(host, "name", host)
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


class ProxyService(MultiService):
    """The whole proxy; stops in order: accept, drain, close, backends.

    Under twistd it also takes over SIGTERM, so that a drained shutdown
    exits 0 (twistd would re-raise the signal and exit with it).
    """

    def __init__(
        self,
        app: ProxyApp,
        site: TrackingSite,
        backends: BackendService,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        handle_sigterm: bool = False,
        log_observer: ILogObserver | None = None,
        config_path: str | None = None,
    ) -> None:
        super().__init__()
        self.log_observer = log_observer
        #: The --config file whose pools SIGHUP reloads.
        self.config_path = config_path
        self.app = app
        self.site = site
        self.backends = backends
        self.drain_timeout = drain_timeout
        self.handle_sigterm = handle_sigterm
        self._ports_closed = Happened()
        backends.setServiceParent(self)

    def setServiceParent(self, parent: Any) -> None:
        """Under twistd the parent is the application: hand it our log observer.

        twistd asks the application for an ``ILogObserver`` component before
        it starts logging, so ``--log-format json`` replaces its text log.
        """
        super().setServiceParent(parent)
        if self.log_observer is not None and hasattr(parent, "setComponent"):
            parent.setComponent(ILogObserver, self.log_observer)

    def listeners(self) -> list[ListenService]:
        return [s for s in self if isinstance(s, ListenService)]

    def startService(self) -> None:
        super().startService()
        if self.handle_sigterm:
            from twisted.internet import reactor

            reactor.callWhenRunning(self._take_sigterm)

    def _take_sigterm(self) -> None:
        from twisted.internet import reactor

        def on_sighup(signum: int, frame: Any) -> None:
            reactor.callFromThread(self.reload_pools)  # type: ignore[attr-defined]

        take_sigterm(reactor)
        signal.signal(signal.SIGHUP, on_sighup)

    def reload_pools(self) -> None:
        """Make the pools what the config file says now; keep them on an error."""
        if self.config_path is None:
            log.warn("SIGHUP: there is no --config file to reload pools from")
            return
        try:
            pools = pools_from_file(self.config_path)
            for pool in self.backends.pools():
                if pool.role in pools:
                    BackendPool(pool.role, pools[pool.role])  # checks every URL first
            for pool in self.backends.pools():
                if pool.role in pools:
                    pool.update(pools[pool.role])
        except (usage.UsageError, ValueError) as error:
            log.error("SIGHUP: pools not reloaded, kept as they were: {error}", error=str(error))
            return
        log.info(
            "SIGHUP: pools reloaded from {path}: prefill {prefill}, decode {decode}",
            path=self.config_path,
            prefill=[i.url for i in self.backends.prefill.instances if not i.draining],
            decode=[i.url for i in self.backends.decode.instances if not i.draining],
        )

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        self.app.start_draining()
        await DeferredList([maybeDeferred(s.stopService) for s in self.listeners()])
        draining = self._drain()  # its timeout runs from now
        self._ports_closed.fire()
        drained = await draining
        await self._close_connections(drained)
        await self.backends.stopService()

    async def _close_connections(self, drained: bool) -> None:
        """Close client connections: gently if drained, at once if not."""
        sites = {listener.site for listener in self.listeners()}
        if drained:
            closing = DeferredList([site.close_connections(abort=False) for site in sites])
            try:
                await closing.addTimeout(CLOSE_GRACE, self.backends.clock)
                return
            except TimeoutError:
                pass
        await DeferredList([site.close_connections(abort=True) for site in sites])

    def when_ports_closed(self) -> Deferred[None]:
        """Fires once a stopping proxy accepts no more connections."""
        return self._ports_closed.wait()

    def _drain(self) -> Deferred[bool]:
        in_flight = self.app.in_flight
        if in_flight:
            log.info("draining {in_flight} requests in flight", in_flight=in_flight)
        drained = self.app.drain().addTimeout(self.drain_timeout, self.backends.clock)

        def timed_out(failure: Failure) -> bool:
            failure.trap(TimeoutError)
            log.warn(
                "drain timeout of {seconds} s: closing {in_flight} requests still in flight",
                seconds=self.drain_timeout,
                in_flight=self.app.in_flight,
            )
            return False

        return drained.addCallbacks(lambda _: True, timed_out)


def json_lines(out: Any) -> ILogObserver:
    """Every log event as one JSON object per line (no RFC 7464 separator)."""
    return jsonFileLogObserver(out, recordSeparator="")


class SupervisorService(MultiService):
    """The parent of ``--workers``: its one child supervises the workers."""

    def __init__(self, supervisor: WorkerSupervisor, handle_sigterm: bool) -> None:
        super().__init__()
        self.handle_sigterm = handle_sigterm
        supervisor.setServiceParent(self)

    def startService(self) -> None:
        super().startService()
        if self.handle_sigterm:
            from twisted.internet import reactor

            reactor.callWhenRunning(take_sigterm, reactor)


def makeService(
    options: Options, clock: IReactorTime | None = None, handle_sigterm: bool = True
) -> MultiService:
    """Build the service tree that ``twistd nixlproxy`` runs."""
    if options["workers"] > 1:
        reserved = reserve(options["tcp_addresses"])
        for sock in reserved:
            host, port = sock.getsockname()[:2]
            log.info("nixlproxy workers share {host}:{port}", host=host, port=port)
        supervisor = WorkerSupervisor(
            worker_args(options.command_line, reserved), options["workers"], reserved
        )
        return SupervisorService(supervisor, handle_sigterm)
    return _proxy(options, clock, handle_sigterm)


def _proxy(options: Options, clock: IReactorTime | None, handle_sigterm: bool) -> ProxyService:
    if clock is None:
        from twisted.internet import reactor

        clock = cast(IReactorTime, reactor)
    if options["reuse-port"]:
        from twisted.internet import reactor as listening_reactor

        options["endpoints"] = [
            ReusePortEndpoint(listening_reactor, host, port)
            for host, port in options["tcp_addresses"]
        ]
    for pool in (options["prefill_pool"], options["decode_pool"]):
        pool.clock = clock
    backends = BackendService(
        options["prefill_pool"],
        options["decode_pool"],
        Upstream(
            max_idle_per_instance=options["max-idle-per-backend"],
            idle_timeout=options["backend-idle-timeout"],
            connect_timeout=options["connect-timeout"],
        ),
        clock=clock,
        health_interval=options["health-interval"],
        health_timeout=options["health-timeout"],
    )
    limits = Limits(
        prefill_timeout=options["prefill-timeout"],
        decode_timeout=options["decode-timeout"],
        stream_idle_timeout=options["stream-idle-timeout"],
        prefill_retries=options["prefill-retries"],
        decode_retries=options["decode-retries"],
    )
    metrics = ProxyMetrics(backends.pools())
    app = ProxyApp(
        backends,
        backend_api_key=options["backend-api-key"],
        limits=limits,
        max_in_flight=options["max-in-flight"],
        clock=clock,
        metrics=metrics,
        serve_metrics=options["metrics_endpoint"] is None,
        admin_token=options["admin-token"],
    )
    access_log = AccessLog(metrics, emit=options["access-log"] == "on")
    site = TrackingSite(
        app.resource(), max_body_size=options["max-body-size"], access_log=access_log
    )
    root = ProxyService(
        app,
        site,
        backends,
        drain_timeout=options["drain-timeout"],
        handle_sigterm=handle_sigterm,
        log_observer=json_lines(sys.stdout) if options["log-format"] == "json" else None,
        config_path=options["config"],
    )
    for endpoint in options["endpoints"]:
        ListenService(endpoint, site).setServiceParent(root)
    if options["metrics_endpoint"] is not None:
        metrics_site = TrackingSite(MetricsResource(metrics))
        ListenService(options["metrics_endpoint"], metrics_site).setServiceParent(root)
    return root


def build(
    args: Sequence[str], clock: IReactorTime | None = None, handle_sigterm: bool = True
) -> ProxyService:
    """Parse ``args`` as ``twistd nixlproxy`` would and build one proxy's service tree."""
    options = Options()
    options.parseOptions(list(args))
    return _proxy(options, clock, handle_sigterm)
