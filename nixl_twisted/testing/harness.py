"""A real proxy built from a ``ProxyConfig``, on loopback or wholly in memory.

- :func:`start_pair` starts a fake prefill and a fake decode sharing a ledger;
- :func:`start_proxy` / :func:`run_proxy` start the proxy's whole service
  tree, as ``twistd nixlproxy`` builds it, in the running reactor;
- :class:`InMemoryProxy` serves the same tree with no socket at all: the
  fakes behind ``treq.testing.RequestTraversalAgent``, each client on a
  ``StringTransport``, every timer on a ``Clock``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treq.testing import RequestTraversalAgent
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, fail, gatherResults, maybeDeferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.web.client import URI
from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from twisted.web.resource import IResource, Resource
from zope.interface import implementer

from nixl_twisted.config import ProxyConfig
from nixl_twisted.run.root import build
from nixl_twisted.testing.fake import FakeVLLM
from nixl_twisted.testing.ledger import TransferLedger
from nixl_twisted.testing.site import netloc

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from nixl_twisted.run.root import ProxyService
    from nixl_twisted.web.app import ProxyApp
    from nixl_twisted.web.site import TrackingSite


@dataclass
class FakePair:
    """A fake prefill and a fake decode sharing one ledger."""

    prefill: FakeVLLM
    decode: FakeVLLM

    def stop(self) -> Deferred[Any]:
        return gatherResults([self.prefill.stop(), self.decode.stop()])


async def start_pair(
    reactor: Any = None,
    prefill_listen: str = "tcp:0:interface=127.0.0.1",
    decode_listen: str = "tcp:0:interface=127.0.0.1",
    **fake_options: Any,
) -> FakePair:
    """Start a fake prefill and a fake decode on loopback that share a ledger."""
    ledger = TransferLedger()
    pair = FakePair(
        FakeVLLM(name="fake-prefill", ledger=ledger, **fake_options),
        FakeVLLM(name="fake-decode", ledger=ledger, **fake_options),
    )
    await pair.prefill.listen(prefill_listen, reactor)
    await pair.decode.listen(decode_listen, reactor)
    return pair


@dataclass
class RunningProxy:
    """A real nixl-twisted service tree, started in this process on loopback."""

    service: ProxyService
    url: str
    #: The proxy's site: its client connections.
    site: TrackingSite

    @property
    def app(self) -> ProxyApp:
        return self.service.app

    def stop(self) -> Deferred[Any]:
        return maybeDeferred(self.service.stopService)


def run_proxy(
    config: ProxyConfig,
    clock: IReactorTime | None = None,
    reactor: Any = None,
    tracer_provider: TracerProvider | None = None,
) -> RunningProxy:
    """Build the proxy from ``config`` exactly as ``twistd nixlproxy`` would, and start it.

    A ``clock`` (such as ``twisted.internet.task.Clock``) drives its
    timeouts, backoffs and health checks, so a test can advance time by
    hand. Stop it with :meth:`RunningProxy.stop` (a trial ``addCleanup``).
    """
    if reactor is None:
        from twisted.internet import reactor as default_reactor

        reactor = default_reactor
    service = build(
        config, reactor, clock=clock, take_signals=False, tracer_provider=tracer_provider
    )
    service.privilegedStartService()
    service.startService()
    host = service.ports()[0].getHost()
    assert isinstance(host, IPv4Address | IPv6Address)
    return RunningProxy(service, f"http://{netloc(host)}", service.site)


def start_proxy(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    listen: str = "tcp:0:interface=127.0.0.1",
    clock: IReactorTime | None = None,
    reactor: Any = None,
    tracer_provider: TracerProvider | None = None,
    **settings: object,
) -> RunningProxy:
    """Start a proxy before these instances; ``settings`` are any other options
    by name (``max_in_flight=8``, ``health_interval=0``), checked as the
    command line's are. ``tracer_provider``: trace with it (an in-memory exporter's)."""
    config = ProxyConfig.create(
        listen=[listen], prefill=list(prefill), decode=list(decode), **settings
    )
    return run_proxy(config, clock=clock, reactor=reactor, tracer_provider=tracer_provider)


class _ByHost(Resource):
    """Routes each in-memory request to the fake whose URL names its host."""

    def __init__(self, fakes: dict[bytes, IResource]) -> None:
        super().__init__()
        self._fakes = fakes

    def getChildWithDefault(self, path: bytes, request: Any) -> IResource:
        request.prepath.pop()
        request.postpath.insert(0, path)
        return self._fakes[request.getHeader(b"host")]


@implementer(IAgent)
class _InMemoryBackends:
    """The fakes as an agent: a host no fake serves refuses the connection, as a dead one."""

    def __init__(self, hosts: dict[bytes, IResource]) -> None:
        #: What each host serves: a host not here refuses the connection.
        self.hosts = hosts
        self.traversal = RequestTraversalAgent(_ByHost(hosts))
        #: Hosts whose connections fail: with what, and whether ``request`` raises it.
        self.broken: dict[bytes, tuple[Exception, bool]] = {}

    def request(
        self,
        method: bytes,
        uri: bytes,
        headers: Headers | None = None,
        bodyProducer: IBodyProducer | None = None,
    ) -> Deferred[IResponse]:
        host = URI.fromBytes(uri).netloc
        if host in self.broken:
            error, raised = self.broken[host]
            if raised:
                raise error
            return fail(error)
        if host not in self.hosts:
            return fail(ConnectionRefusedError(uri.decode("ascii", "replace")))
        return self.traversal.request(method, uri, headers, bodyProducer)


@dataclass
class Answer:
    """An HTTP response as a client read it (a chunked body decoded)."""

    status: int
    #: Each header by its lower-case name (the last value of one sent twice).
    headers: dict[str, str]
    body: bytes
    #: The body ended as HTTP says it must (last chunk, or the announced length).
    complete: bool
    #: Every header line in order, names in lower case: see :meth:`values`.
    lines: list[tuple[str, str]] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)

    def values(self, name: str) -> list[str]:
        """Every value of header ``name``, in the order sent (none: an empty list)."""
        return [value for key, value in self.lines if key == name.lower()]


def parse_answer(raw: bytes) -> Answer:
    """Parse the bytes of one HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *raw_lines = head.decode("latin-1").split("\r\n")
    lines = [(k.strip().lower(), v.strip()) for k, _, v in (h.partition(":") for h in raw_lines)]
    headers = dict(lines)
    status = int(status_line.split()[1])
    if headers.get("transfer-encoding") == "chunked":
        body, complete = b"", False
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                complete = True
                break
            body, rest = body + rest[:size], rest[size + 2 :]
        return Answer(status, headers, body, complete, lines)
    length = int(headers.get("content-length", len(rest)))
    return Answer(status, headers, rest[:length], len(rest) >= length, lines)


class InMemoryClient:
    """One client connection to an :class:`InMemoryProxy`, on a ``StringTransport``."""

    def __init__(
        self, proxy: InMemoryProxy, channel: HTTPChannel, peer: IPv4Address | None = None
    ) -> None:
        """``peer``: the client's address, as the proxy sees it."""
        self.proxy = proxy
        self.channel = channel
        self.transport = StringTransport(peerAddress=peer)
        channel.makeConnection(self.transport)
        self.lost = False

    def send(self, raw: bytes) -> None:
        self.channel.dataReceived(raw)
        self.proxy.flush()

    def received(self) -> bytes:
        """Every byte the proxy has written to this client so far."""
        return self.transport.value()

    def answer(self) -> Answer:
        """The response received so far, parsed."""
        return parse_answer(self.received())

    def disconnect(self) -> None:
        """The client goes away."""
        if not self.lost:
            self.lost = True
            self.channel.connectionLost(Failure(ConnectionDone()))
        self.proxy.flush()


class InMemoryProxy:
    """The proxy's service tree with no socket: fakes in memory, time on a ``Clock``."""

    #: Rounds of pumping in :meth:`flush`: every leg of a request and its
    #: answer move within a few; more rounds cost nothing when idle.
    ROUNDS = 20

    def __init__(
        self,
        prefills: Sequence[FakeVLLM],
        decodes: Sequence[FakeVLLM],
        clock: Clock | None = None,
        tracer_provider: TracerProvider | None = None,
        start: bool = True,
        **settings: object,
    ) -> None:
        """``tracer_provider``: trace with it (an in-memory exporter's), as ``start_proxy``.

        ``start=False``: the backends (their health checks) start only at
        :meth:`start`, so that a test may stop serving a fake first.
        """
        self.clock = clock if clock is not None else Clock()
        self.agent = _InMemoryBackends({})
        for fake in [*prefills, *decodes]:
            self.serve(fake)
        settings.setdefault("health_interval", 0)
        # The settings may name the pools' URLs themselves (data-parallel ranks).
        settings.setdefault("prefill", [f.url for f in prefills])
        settings.setdefault("decode", [f.url for f in decodes])
        config = ProxyConfig.create(**settings)
        self.service = build(
            config,
            MemoryReactorClock(),
            clock=self.clock,
            agent=self.agent,
            take_signals=False,
            tracer_provider=tracer_provider,
        )
        self.clients: list[InMemoryClient] = []
        if start:
            self.start()

    def start(self) -> None:
        """Start the backends: the first round of health checks, if any, goes out now."""
        self.service.backends.startService()
        self.flush()

    def serve(self, fake: FakeVLLM, resource: IResource | None = None) -> str:
        """Serve ``fake`` at its in-memory URL (again), on this proxy's clock; return the URL.

        ``resource``: serve that instead of the fake's own (a wrapper of
        ``fake.resource()``, say). A fake added after the proxy was made
        (for the admin API) is served so too.
        """
        fake.clock = self.clock
        fake.url = f"http://{fake.name}.memory"
        self.agent.hosts[f"{fake.name}.memory".encode()] = resource or fake.resource()
        return fake.url

    def stop_serving(self, fake: FakeVLLM) -> None:
        """From now on, connecting to ``fake`` is refused, as to a stopped instance."""
        del self.agent.hosts[f"{fake.name}.memory".encode()]

    @property
    def app(self) -> ProxyApp:
        return self.service.app

    def connect(self) -> InMemoryClient:
        """A new client connection, from a loopback address."""
        peer = IPv4Address("TCP", "127.0.0.1", 40000)
        channel = self.service.site.buildProtocol(peer)
        assert isinstance(channel, HTTPChannel)
        client = InMemoryClient(self, channel, peer)
        self.clients.append(client)
        return client

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> InMemoryClient:
        """Send one HTTP/1.1 request on a new connection.

        ``Host`` and ``Content-Length`` are added unless ``headers`` has its
        own (or a ``Transfer-Encoding``), as ``http.client`` does.
        """
        given = {name.lower() for name in headers or {}}
        lines = [f"{method} {path} HTTP/1.1"]
        lines += [] if "host" in given else ["Host: proxy.memory"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        if not given & {"content-length", "transfer-encoding"}:
            lines.append(f"Content-Length: {len(body)}")
        client = self.connect()
        client.send(("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + body)
        return client

    def break_connections(self, fake: FakeVLLM, error: Exception, raised: bool = False) -> None:
        """From now on, connecting to ``fake`` fails with ``error``, whatever it is.

        The agent's ``request`` returns it as a failed Deferred or, with
        ``raised``, raises it at once: both ways a connect path may fail.
        """
        self.agent.broken[URI.fromBytes(fake.url.encode()).netloc] = (error, raised)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on the clock, then move what that set off."""
        self.clock.advance(seconds)
        self.flush()

    def flush(self) -> None:
        """Move every byte waiting between proxy, fakes and clients."""
        for _ in range(self.ROUNDS):
            self.agent.traversal.flush()
            for client in self.clients:
                if client.transport.disconnecting and not client.lost:
                    # The proxy closed this connection: tell it the close happened.
                    client.lost = True
                    client.channel.connectionLost(Failure(ConnectionDone()))
