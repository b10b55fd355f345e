"""The proxy's whole service tree wholly in memory: no socket, every timer on a ``Clock``.

:class:`InMemoryProxy` builds the tree as ``twistd nixlproxy`` does, with the
fakes behind ``treq.testing.RequestTraversalAgent`` and each client
(:class:`InMemoryClient`) on a ``StringTransport``; what a client read is an
:class:`Answer`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treq.testing import RequestTraversalAgent
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail
from twisted.internet.error import ConnectionDone
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

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from nixl_twisted.web.app import ProxyApp


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
        self.service.checks.startService()
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
