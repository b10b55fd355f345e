"""``FakeVLLM``: one fake vLLM instance, playing prefill and decode as NIXL-enabled vLLM does.

Like a real instance started with the NixlConnector, it decides its role per
request from ``kv_transfer_params``: ``do_remote_decode`` (a prefill leg)
answers one token and params recorded in a shared ``TransferLedger``;
``do_remote_prefill`` (a decode leg) checks the params are exactly ones a
prefill issued (a KV-load failure, 500, if not) and generates; anything
else generates as a plain instance. It serves on its own ``Site``, never
the proxy's, so a proxy bug cannot hide on both sides of a test.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from klein import Klein
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import CancelledError, Deferred, DeferredList, maybeDeferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IPushProducer, IReactorTime
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers
from twisted.web.server import Request, Site
from zope.interface import implementer

from nixl_twisted.testing import answers
from nixl_twisted.testing.behaviours import (
    Behaviour,
    ErrorAnswer,
    RawAnswer,
    break_off,
    omit_kv_transfer_params,
)
from nixl_twisted.testing.ledger import TransferLedger

JSONObject = dict[str, Any]

DEFAULT_TEXT = (
    "Hello from the fake decode instance: these tokens were prefilled on one "
    "instance, moved over NIXL and generated on another, all through nixl-twisted."
)


class _Channel(HTTPChannel):
    factory: FakeSite

    def connectionMade(self) -> None:
        super().connectionMade()
        self.factory._opened(self)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        try:
            super().connectionLost(reason)
        finally:
            self.factory._closed(self)


class FakeSite(Site):
    """The fake's ``Site``: it knows its open connections, to report and close them."""

    protocol = _Channel  # type: ignore[assignment]

    def __init__(self, resource: Any) -> None:
        super().__init__(resource)
        self._open: dict[HTTPChannel, list[Deferred[None]]] = {}
        #: Connections accepted since the site was made (open or not).
        self.connections_accepted = 0

    def channels(self) -> list[HTTPChannel]:
        """The HTTP channels open now."""
        return list(self._open)

    def connection_lost(self, channel: HTTPChannel) -> Deferred[None]:
        """Fires when an open channel's connection is gone."""
        waiting: Deferred[None] = Deferred()
        self._open[channel].append(waiting)
        return waiting

    def close_connections(self) -> Deferred[Any]:
        """Drop every open connection; fires when all are gone."""
        waiting = [self.connection_lost(channel) for channel in self._open]
        for channel in list(self._open):
            channel.transport.abortConnection()  # type: ignore[union-attr]
        return DeferredList(waiting)

    def _opened(self, channel: HTTPChannel) -> None:
        self._open[channel] = []
        self.connections_accepted += 1

    def _closed(self, channel: HTTPChannel) -> None:
        for waiting in self._open.pop(channel, []):
            waiting.callback(None)


@dataclass
class ReceivedRequest:
    """One request as the fake saw it."""

    method: str
    path: str
    headers: Headers
    body: JSONObject | None
    role: str  # "prefill", "decode", "plain" or "other"
    query: bytes = b""

    @property
    def request_id(self) -> str | None:
        """The ``X-Request-Id`` header, as vLLM would use it."""
        values = self.headers.getRawHeaders(b"x-request-id")
        return values[0].decode("ascii") if values else None

    @property
    def authorization(self) -> str | None:
        values = self.headers.getRawHeaders(b"authorization")
        return values[0].decode("utf-8") if values else None


@dataclass
class FakeVLLM:
    """A fake vLLM instance; ``tokens`` per answer, ``token_interval`` s apart."""

    name: str = "fake-vllm"
    ledger: TransferLedger = field(default_factory=TransferLedger)
    tokens: int = 8
    token_interval: float = 0.0
    model: str = "fake-model"
    text: str = DEFAULT_TEXT
    clock: IReactorTime | None = None
    requests: list[ReceivedRequest] = field(default_factory=list)
    #: Streams whose client went away before the stream ended.
    disconnects: int = 0
    #: Headers added to every generation answer, e.g. to test header rules.
    extra_headers: dict[str, str] = field(default_factory=dict)
    #: ``GET /health`` checks received, and the status they are answered with.
    health_checks: int = 0
    health_status: int = 200

    def __post_init__(self) -> None:
        self._script: list[Behaviour] = []
        self._hold_after: int | None = None
        self._hold_midway = False
        self._firehose: tuple[int, int] | None = None
        self._paused_waiters: list[Deferred[None]] = []
        self._health_waiters: list[Deferred[None]] = []
        self.firehose_written = 0
        self._release: Deferred[None] = Deferred()
        self._held: list[Deferred[None]] = []
        self._port: IListeningPort | None = None
        #: The fake's site: its open connections, and how many it accepted.
        self.site = FakeSite(self.resource())
        self.url = ""
        self._kv_port = 5600

    # -- what a test tells the fake ----------------------------------------

    def script(self, *behaviours: Behaviour) -> None:
        """Answer the next requests so, one behaviour each, in order."""
        self._script.extend(behaviours)

    def refuse_next(self, status: int = 400, message: str = "bad request") -> None:
        """Answer the next request with a 4xx and vLLM's OpenAI error body."""
        self.script(ErrorAnswer(status=status, message=message))

    def crash_next(self, status: int = 500, message: str = "engine error") -> None:
        """Answer the next request with a 5xx, as a failing engine does."""
        self.script(ErrorAnswer(status=status, message=message))

    def omit_kv_transfer_params_next(self) -> None:
        """Answer the next prefill leg without ``kv_transfer_params``."""
        self.script(omit_kv_transfer_params())

    def answer_next_with(
        self, status: int, body: bytes, content_type: bytes = b"application/json"
    ) -> None:
        """Answer the next request with exactly these bytes (garbage included)."""
        self.script(RawAnswer(status=status, body=body, content_type=content_type))

    def break_next(self, after_events: int = 1) -> None:
        """Cut the next answer off: a stream after ``after_events`` events, a
        JSON answer halfway through its announced ``Content-Length``."""
        self.script(break_off(after_events))

    def hold_streams_after(self, chunks: int) -> None:
        """Let streams write ``chunks`` events, then wait for :meth:`release`."""
        self._hold_after = chunks

    def hold_answers(self) -> None:
        """Hold every answer, JSON or stream, before its first byte."""
        self._hold_after = 0
        self._hold_midway = False

    def hold_answers_midway(self) -> None:
        """Send JSON answers' headers and first half, then hold the rest."""
        self._hold_after = 0
        self._hold_midway = True

    def firehose(self, event_bytes: int = 64 * 1024, total_bytes: int = 64 * 1024 * 1024) -> None:
        """Make streams write big events as fast as the connection takes them.

        The fake writes only while its connection is not paused, so what it
        has written (``firehose_written``) shows whether backpressure reached
        it; ``firehose_paused()`` fires the first time it is paused.
        """
        self._firehose = (event_bytes, total_bytes)

    def firehose_paused(self) -> Deferred[None]:
        waiting: Deferred[None] = Deferred()
        self._paused_waiters.append(waiting)
        return waiting

    def next_health_check(self) -> Deferred[None]:
        """Fires when the next ``GET /health`` arrives."""
        waiting: Deferred[None] = Deferred()
        self._health_waiters.append(waiting)
        return waiting

    def stream_held(self) -> Deferred[None]:
        """Fires when a stream reaches the hold point."""
        waiting: Deferred[None] = Deferred()
        self._held.append(waiting)
        return waiting

    def release(self) -> None:
        """Let held streams (and streams that reach the hold point) go on."""
        self._hold_after = None
        release, self._release = self._release, Deferred()
        release.callback(None)

    def requests_for(self, role: str) -> list[ReceivedRequest]:
        return [r for r in self.requests if r.role == role]

    # -- serving -----------------------------------------------------------

    async def listen(
        self, description: str = "tcp:0:interface=127.0.0.1", reactor: Any = None
    ) -> str:
        """Serve on a Twisted endpoint; return the base URL."""
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        if self.clock is None:
            self.clock = reactor
        self._port = await serverFromString(reactor, description).listen(self.site)
        host = self._port.getHost()
        assert isinstance(host, IPv4Address | IPv6Address)
        scheme = "https" if description.startswith("ssl:") else "http"
        self.url = f"{scheme}://{netloc(host)}"
        self._kv_port = 5600 + host.port % 1000
        return self.url

    def stop(self) -> Deferred[Any]:
        """Stop listening and close open connections (held streams are released)."""
        if self._hold_after is not None:
            self.release()
        if self._port is None:
            return succeed(None)
        port, self._port = self._port, None
        return maybeDeferred(port.stopListening).addCallback(
            lambda _: self.site.close_connections()
        )

    def resource(self) -> Any:
        app = Klein()
        app.route("/health", methods=["GET"])(self._health)
        app.route("/v1/models", methods=["GET"])(self._models)
        app.route("/v1/completions", methods=["POST"])(self._generate)
        app.route("/v1/chat/completions", methods=["POST"])(self._generate)
        return app.resource()

    def _record(self, request: Request, body: JSONObject | None, role: str) -> None:
        self.requests.append(
            ReceivedRequest(
                method=request.method.decode("ascii"),
                path=request.path.decode("utf-8"),
                headers=request.requestHeaders.copy(),
                body=body,
                role=role,
                query=request.uri.partition(b"?")[2],
            )
        )

    def _health(self, request: Request) -> bytes:
        # Counted apart: health checks are not the API requests tests assert on.
        self.health_checks += 1
        request.setResponseCode(self.health_status)
        waiters, self._health_waiters = self._health_waiters, []
        for waiting in waiters:
            waiting.callback(None)
        return b""

    def _models(self, request: Request) -> bytes:
        self._record(request, None, "other")
        request.setHeader(b"Content-Type", b"application/json")
        return answers.models(self.model)

    async def _generate(self, request: Request) -> bytes | None:
        try:
            return await self._answer(request)
        except CancelledError:
            # Klein cancels the handler when the client goes away.
            self.disconnects += 1
            raise

    async def _answer(self, request: Request) -> bytes | None:
        assert request.content is not None
        body = json.loads(request.content.read())
        kv = body.get("kv_transfer_params")
        role = "plain"
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            role = "prefill"
        elif isinstance(kv, dict) and kv.get("do_remote_prefill"):
            role = "decode"
        self._record(request, body, role)
        chat = request.path.endswith(b"/chat/completions")
        request.setHeader(b"Content-Type", b"application/json")
        for name, value in self.extra_headers.items():
            request.setHeader(name.encode("ascii"), value.encode("utf-8"))

        behaviour = self._script.pop(0) if self._script else Behaviour()
        instead = behaviour.instead()
        if instead is not None:
            status, content_type, raw = instead
            request.setResponseCode(status)
            request.setHeader(b"Content-Type", content_type)
            return raw

        prompt_tokens = answers.prompt_tokens(body, chat)
        cached = 0
        kv_answer: JSONObject | None = None
        if role == "prefill" and behaviour.issues_params:
            request_id = _header(request, b"x-request-id") or uuid.uuid4().hex
            kv_answer = self.ledger.issue(self.name, request_id, prompt_tokens, self._kv_port)
        elif role == "decode":
            problem = self.ledger.redeem(kv)
            if problem is not None:
                request.setResponseCode(500)
                return answers.vllm_error(500, f"KV load failed: {problem}")
            cached = int(kv.get("remote_prefill_cached_tokens", 0))

        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        count = self.tokens if not isinstance(limit, int) else min(self.tokens, limit)
        words = answers.words(self.text, count)
        answer = answers.Answer(
            chat=chat,
            model=str(body.get("model", self.model)),
            words=words,
            finish_reason="length" if count == limit else "stop",
            usage={
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(words),
                "total_tokens": prompt_tokens + len(words),
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        )
        if not body.get("stream"):
            return await self._whole(request, answer, kv_answer, behaviour.cut_after is not None)
        if self._firehose is not None:
            await self._pour(request, *self._firehose)
            return None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = answer.events(include_usage)
        if behaviour.cut_after is not None:
            await self._stream(request, events[: behaviour.cut_after])
            await _cut_off(request)
            return None
        await self._stream(request, events)
        return None

    async def _whole(
        self, request: Request, answer: answers.Answer, kv: JSONObject | None, broken: bool
    ) -> bytes | None:
        if self._hold_after is not None and not self._hold_midway:
            await self._wait_at_hold()
        whole = answer.whole()
        if kv is not None:
            whole["kv_transfer_params"] = kv
        raw = answers.encode(whole)
        if not broken and not (self._hold_after is not None and self._hold_midway):
            return raw
        request.setHeader(b"Content-Length", str(len(raw)).encode("ascii"))
        request.write(raw[: len(raw) // 2])
        if broken:
            await _cut_off(request)
            return None
        await self._wait_at_hold()
        request.write(raw[len(raw) // 2 :])
        return None

    async def _stream(self, request: Request, events: list[bytes]) -> None:
        request.setHeader(b"Content-Type", b"text/event-stream")
        for index, event in enumerate(events):
            if self._hold_after is not None and index >= self._hold_after:
                await self._wait_at_hold()
            request.write(event)
            if self.token_interval > 0 and index < len(events) - 1:
                await deferLater(self.clock, self.token_interval)  # type: ignore[arg-type]

    async def _pour(self, request: Request, event_bytes: int, total_bytes: int) -> None:
        request.setHeader(b"Content-Type", b"text/event-stream")
        pour = _Pour(self, request, event_bytes, total_bytes)
        request.registerProducer(pour, True)
        pour.resumeProducing()
        await pour.done
        request.unregisterProducer()

    def _paused(self) -> None:
        waiters, self._paused_waiters = self._paused_waiters, []
        for waiting in waiters:
            waiting.callback(None)

    async def _wait_at_hold(self) -> None:
        held, self._held = self._held, []
        for waiting in held:
            waiting.callback(None)
        await self._release_signal()

    def _release_signal(self) -> Deferred[None]:
        waiting: Deferred[None] = Deferred()
        self._release.addBoth(lambda _: waiting.callback(None) if not waiting.called else None)
        return waiting


@implementer(IPushProducer)
class _Pour:
    """Writes SSE events of ``event_bytes`` while the connection is not paused."""

    def __init__(self, fake: FakeVLLM, request: Request, event_bytes: int, total: int) -> None:
        self.fake = fake
        self.request = request
        self.event = b"data: " + b"x" * (event_bytes - 8) + b"\n\n"
        self.total = total
        self.paused = False
        self.done: Deferred[None] = Deferred()

    def resumeProducing(self) -> None:
        self.paused = False
        while not self.paused and self.fake.firehose_written < self.total:
            self.fake.firehose_written += len(self.event)
            self.request.write(self.event)
        if self.fake.firehose_written >= self.total and not self.done.called:
            self.done.callback(None)

    def pauseProducing(self) -> None:
        self.paused = True
        self.fake._paused()

    def stopProducing(self) -> None:
        self.paused = True
        if not self.done.called:
            self.done.errback(CancelledError("the client went away"))


async def _cut_off(request: Request) -> None:
    """Close the connection mid-answer, as a crashing backend would."""
    if request.channel is None:
        return
    lost: Deferred[None] = request.notifyFinish()
    request.channel.loseConnection()
    with contextlib.suppress(Exception):
        await lost


def _header(request: Request, name: bytes) -> str | None:
    values = request.requestHeaders.getRawHeaders(name)
    return values[0].decode("ascii") if values else None


def netloc(address: IPv4Address | IPv6Address) -> str:
    """``host:port`` for a URL, an IPv6 host in brackets."""
    if isinstance(address, IPv6Address):
        return f"[{address.host}]:{address.port}"
    return f"{address.host}:{address.port}"
