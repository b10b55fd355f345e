"""``twistd nixlproxy``: the options and the service tree they build.

The tree is a ``MultiService`` with the ``BackendService`` (pools and the
pooled HTTP client) and one listening service per ``--listen`` endpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure

from nixl_twisted import identity
from nixl_twisted.app import ProxyApp
from nixl_twisted.pools import BackendPool, BackendService, InvalidBackendURL
from nixl_twisted.site import TrackingSite
from nixl_twisted.upstream import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_IDLE_PER_INSTANCE,
    Upstream,
)

log = Logger()

#: The environment variable that holds the backend API key, so that the key
#: need not appear in a process listing.
BACKEND_API_KEY_ENV = "NIXLPROXY_BACKEND_API_KEY"


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


def _positive_int(name: str) -> Any:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"--{name} must be a whole number, not {value!r}") from None
        if number < 1:
            raise ValueError(f"--{name} must be at least 1, not {value!r}")
        return number

    return parse


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
    ]

    def __init__(self) -> None:
        super().__init__()
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
        from twisted.internet import reactor

        self["endpoints"] = [_endpoint(reactor, desc) for desc in self["listen"]]


def _endpoint(reactor: Any, description: str) -> IStreamServerEndpoint:
    try:
        return serverFromString(reactor, description)
    except (ValueError, KeyError, TypeError) as error:
        raise usage.UsageError(
            f"--listen {description!r} is not a usable endpoint: {error}"
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
        """Stop accepting, then close the connections still open."""
        super().stopService()
        stopped: Deferred[Any] = succeed(None)
        if self.port is not None:
            port, self.port = self.port, None
            stopped = maybeDeferred(port.stopListening)
        return stopped.addCallback(lambda _: self.site.close_connections())


def _address(port: IListeningPort) -> str:
    host = port.getHost()
    if hasattr(host, "port"):
        return f"{host.host}:{host.port}"  # type: ignore[attr-defined]
    name = getattr(host, "name", host)
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


def proxy_site(app: ProxyApp) -> TrackingSite:
    """The Twisted Web site for the app; tracebacks never reach a client."""
    return TrackingSite(app.resource())


def makeService(options: Options) -> IService:
    """Build the service tree that ``twistd nixlproxy`` runs."""
    backends = BackendService(
        options["prefill_pool"],
        options["decode_pool"],
        Upstream(
            max_idle_per_instance=options["max-idle-per-backend"],
            idle_timeout=options["backend-idle-timeout"],
            connect_timeout=options["connect-timeout"],
        ),
    )
    site = proxy_site(ProxyApp(backends, backend_api_key=options["backend-api-key"]))
    root = MultiService()
    backends.setServiceParent(root)
    for endpoint in options["endpoints"]:
        ListenService(endpoint, site).setServiceParent(root)
    return root


def build(args: Sequence[str]) -> IService:
    """Parse ``args`` as ``twistd nixlproxy`` would and build its service tree."""
    options = Options()
    options.parseOptions(list(args))
    return makeService(options)
