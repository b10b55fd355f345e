"""What the loopback and process tests share: fakes and a proxy on loopback, and a client."""

from __future__ import annotations

import json
import os
import re
import typing
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IResponse
from zope.interface import provider

from nixl_twisted.discovery.service import Discovery
from nixl_twisted.testing import FakeVLLM, RunningProxy, TransferLedger, start_proxy
from nixl_twisted.testing.dnsmasq import Dnsmasq, DnsmasqMissing
from nixl_twisted.testing.redis import RedisMissing, RedisServer

T = TypeVar("T")

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello there"}],
    "temperature": 1.0,
    "reasoning_effort": "high",
    "chat_template_kwargs": {"enable_thinking": True},
}


class ProxyCase(TestCase):
    """A trial test with fake prefill and decode instances and a real proxy."""

    timeout = 8

    async def start(
        self,
        prefills: int = 1,
        decodes: int = 1,
        proxy: dict[str, object] | None = None,
        **fake_options: Any,
    ) -> None:
        self.ledger = TransferLedger()
        self.prefills = [
            FakeVLLM(name=f"prefill-{i}", ledger=self.ledger, **fake_options)
            for i in range(prefills)
        ]
        self.decodes = [
            FakeVLLM(name=f"decode-{i}", ledger=self.ledger, **fake_options) for i in range(decodes)
        ]
        for fake in self.prefills + self.decodes:
            await fake.listen()
            self.addCleanup(fake.stop)
        #: Drives the proxy's timeouts, backoffs and health checks: tests
        #: advance it by hand, so nothing waits on the wall clock.
        self.clock = Clock()
        self.proxy = self.start_proxy(
            [f.url for f in self.prefills],
            [f.url for f in self.decodes],
            **(proxy or {}),  # type: ignore[arg-type]
        )
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)
        self.agent = Agent(reactor, pool=pool)
        self.http = HTTPClient(self.agent)

    def logged(self) -> list[dict[str, Any]]:
        """Every log event from now to the end of the test, as emitted."""
        events: list[dict[str, Any]] = []
        self._observe(lambda event: events.append(event))
        return events

    def access_events(self) -> list[dict[str, Any]]:
        """The fields of each access event from now to the end of the test."""
        fields: list[dict[str, Any]] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_namespace") == "nixlproxy.access":
                fields.append(event["access"])

        self._observe(observe)
        return fields

    def _observe(self, observe: Any) -> None:
        observer = provider(ILogObserver)(observe)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def start_proxy(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        listen: str = "tcp:0:interface=127.0.0.1",
        **settings: object,
    ) -> RunningProxy:
        # Active health checks are off unless a test turns them on: they
        # would race the requests a test sends.
        settings.setdefault("health_interval", 0)
        proxy = start_proxy(
            prefill, decode, listen=listen, clock=self.clock, **cast(dict[str, Any], settings)
        )
        self.addCleanup(proxy.stop)
        return proxy

    def start_proxy_on(self, listen: str) -> RunningProxy:
        """Another proxy before the same fakes, on another endpoint."""
        return self.start_proxy(
            [f.url for f in self.prefills], [f.url for f in self.decodes], listen=listen
        )

    async def held_stream(
        self,
        fake: FakeVLLM | None = None,
        after: int = 1,
        path: str = "/v1/chat/completions",
        body: object = None,
    ) -> ChunkCollector:
        """A streaming request whose decode holds after ``after`` events.

        Returns once the fake holds the stream; ``fake.release()`` lets it go on.
        """
        fake = fake or self.decode
        fake.hold_streams_after(after)
        held = fake.stream_held()
        response = await self.post(path, body if body is not None else dict(CHAT, stream=True))
        collector = ChunkCollector()
        response.deliverBody(collector)
        await held
        return collector

    def ensure(self, coroutine: Coroutine[Any, Any, T]) -> Deferred[T]:
        return ensureDeferred(coroutine)

    @property
    def prefill(self) -> FakeVLLM:
        return self.prefills[0]

    @property
    def decode(self) -> FakeVLLM:
        return self.decodes[0]

    def post(self, path: str, body: object, headers: dict[str, str] | None = None) -> Deferred[Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        sent: dict[str | bytes, str | bytes] = {"Content-Type": "application/json"}
        sent.update(headers or {})
        return self.http.post(self.proxy.url + path, data=raw, headers=sent, unbuffered=True)

    async def post_json(
        self, path: str, body: object, headers: dict[str, str] | None = None
    ) -> tuple[IResponse, Any]:
        response = await self.post(path, body, headers)
        return response, json.loads(await response.content())

    def assertError(self, response: IResponse, answer: Any, status: int, code: str) -> None:
        """An OpenAI-style error body with the status and code expected."""
        self.assertEqual(response.code, status)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
        self.assertEqual(set(answer["error"]), {"message", "type", "param", "code"})
        self.assertEqual(answer["error"]["code"], code)
        self.assertTrue(answer["error"]["message"])


class DiscoveryCase(ProxyCase):
    """A proxy whose pools discovery fills: what it serves, and waits for its changes."""

    def discovery(self) -> Discovery:
        found = self.proxy.service.discovery
        assert found is not None
        return found

    async def until(self, holds: Callable[[], bool]) -> None:
        """Wait, change by change, until ``holds()``: each wait is for an applied change."""
        while not holds():
            await self.discovery().changed()

    def serving(self, role: str) -> list[str]:
        pool = self.proxy.service.backends.pool(role)
        assert pool is not None
        return sorted(i.url for i in pool.instances if not i.draining)


class Arrivals:
    """What arrives, in order, each taken by one ``next()``: at once if it came already."""

    def __init__(self) -> None:
        self.arrived: list[Any] = []
        self.waiting: list[Deferred[Any]] = []

    def put(self, item: Any) -> None:
        if self.waiting:
            self.waiting.pop(0).callback(item)
        else:
            self.arrived.append(item)

    def next(self) -> Deferred[Any]:
        waiting: Deferred[Any] = Deferred()
        if self.arrived:
            waiting.callback(self.arrived.pop(0))
        else:
            self.waiting.append(waiting)
        return waiting


class ChunkCollector(Protocol):
    """Collects a streamed body; ``done`` fires with its chunks at its end."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.done: Deferred[list[bytes]] = Deferred()

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(self.chunks)
        else:
            self.done.errback(reason)


#: An answer's ids and times: its own in each answer, the same in all its events.
_IDS = re.compile(rb'"((?:chatcmpl-|cmpl-|resp_|msg_)[0-9a-f]+)"')
_TIMES = re.compile(rb'"(created|created_at)":\d+')


def as_one(body: bytes) -> bytes:
    """``body`` with its ids and times in a word, once each is shown to be one answer's:
    every id of a kind (a chat's, a response's, an item's) is the same throughout."""
    kinds: dict[bytes, set[bytes]] = defaultdict(set)
    for found in _IDS.finditer(body):
        kinds[found.group(1).split(b"-")[0].split(b"_")[0]].add(found.group(1))
    spread = {kind: ids for kind, ids in kinds.items() if len(ids) > 1}
    # (a Responses answer has two ids of kind msg: its item's and no other)
    assert not spread, f"an answer with several ids of one kind: {spread}"
    return _TIMES.sub(rb'"\1":0', _IDS.sub(b'"ID"', body))


def assert_same_answer(got: bytes, reference: bytes) -> None:
    """``got`` is ``reference`` byte for byte, but for the answer's own id and time."""
    assert as_one(got) == as_one(reference)


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body, ``[DONE]`` as the string."""
    events: list[Any] = []
    for block in body.decode("utf-8").split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def real_redis(case: TestCase, *options: str, tls_for: str | None = None) -> RedisServer:
    """A redis-server on loopback (with these options of its own; with TLS too, its
    certificate for ``tls_for``), stopped after ``case`` (``make test`` installs it)."""
    return await _started(case, RedisServer(reactor, options, tls_for), RedisMissing)


async def real_dnsmasq(
    case: TestCase, names: dict[str, list[str]], options: Sequence[str] = ()
) -> Dnsmasq:
    """A dnsmasq on loopback answering ``names``, stopped after ``case`` (``make test``
    installs it)."""
    return await _started(case, Dnsmasq(reactor, names, options), DnsmasqMissing)


class _RealServer(typing.Protocol):
    """A real server a test starts: redis-server, dnsmasq."""

    async def start(self) -> None: ...

    async def cleanup(self) -> None: ...


Server = TypeVar("Server", bound=_RealServer)


async def _started(case: TestCase, server: Server, missing: type[Exception]) -> Server:
    """``server`` started, and cleaned up after ``case``; one the machine lacks (``missing``)
    skips the test outside CI and fails it with CI set (``make test`` installs them)."""
    case.addCleanup(server.cleanup)
    try:
        await server.start()
    except missing as error:
        if os.environ.get("CI"):
            raise
        raise SkipTest(str(error)) from None
    return server
