"""A fake vLLM for trial tests: plays prefill and decode as NIXL-enabled vLLM does.

Like a real instance started with the NixlConnector, a :class:`FakeVLLM`
decides its role per request from ``kv_transfer_params``:

- ``do_remote_decode: true`` (a prefill leg): answers one token and
  ``kv_transfer_params`` shaped like current vLLM's, recorded in a shared
  :class:`TransferLedger`;
- ``do_remote_prefill: true`` (a decode leg): checks that the params are
  exactly ones a prefill issued (a KV-load failure, 500, if not) and
  generates, streaming SSE when asked;
- anything else: generates as a plain instance.

It records every request, can hold a stream open until the test releases
it, and can be told to fail the ways vLLM fails. Start a pair with
:func:`start_pair`, or from a shell with ``python -m nixl_twisted.testing``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from klein import Klein
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IPushProducer, IReactorTime
from twisted.internet.task import deferLater
from twisted.web.http_headers import Headers
from twisted.web.server import Request
from zope.interface import implementer

from nixl_twisted.site import TrackingSite

if TYPE_CHECKING:
    from nixl_twisted.app import ProxyApp
    from nixl_twisted.tap import ProxyService

JSONObject = dict[str, Any]

DEFAULT_TEXT = (
    "Hello from the fake decode instance: these tokens were prefilled on one "
    "instance, moved over NIXL and generated on another, all through nixl-twisted."
)


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


class TransferLedger:
    """What prefills issued, so that decodes can check they got exactly that.

    Share one ledger between a fake prefill and a fake decode: a decode leg
    whose ``kv_transfer_params`` differ in any key (one dropped, one rebuilt)
    from what a prefill issued fails as a KV load does.
    """

    def __init__(self) -> None:
        self.issued: dict[str, JSONObject] = {}
        self.redeemed: list[JSONObject] = []

    def issue(
        self, engine_id: str, request_id: str, prompt_tokens: int, kv_port: int
    ) -> JSONObject:
        remote_request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        blocks = max(1, (prompt_tokens + 15) // 16)
        params: JSONObject = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            # One list of block ids per KV-cache group, as current vLLM sends.
            "remote_block_ids": [list(range(blocks)), list(range(100, 100 + blocks))],
            "remote_request_id": remote_request_id,
            "remote_host": "127.0.0.1",
            "remote_port": kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": prompt_tokens // 2,
            # A key that does not exist yet: a proxy must pass it on too.
            "x_future_key": {"nested": [1, [2, 3]], "flag": None},
        }
        self.issued[remote_request_id] = params
        return params

    def redeem(self, params: object) -> str | None:
        """Consume issued params; return why they cannot be loaded, or None."""
        if not isinstance(params, dict):
            return "kv_transfer_params is not an object"
        issued = self.issued.get(str(params.get("remote_request_id")))
        if issued is None:
            return "no prefill issued these kv_transfer_params"
        if params != issued:
            return "kv_transfer_params differ from what prefill issued"
        del self.issued[str(params["remote_request_id"])]
        self.redeemed.append(params)
        return None


@dataclass
class _Failure:
    kind: str  # "error", "omit_kv_transfer_params", "break" or "raw"
    status: int = 200
    message: str = ""
    after_events: int = 0
    body: bytes = b""
    content_type: bytes = b"application/json"


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
        self._failures: list[_Failure] = []
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
        self.site = TrackingSite(self.resource())
        self.url = ""
        self._kv_port = 5600

    # -- what a test tells the fake ----------------------------------------

    def refuse_next(self, status: int = 400, message: str = "bad request") -> None:
        """Answer the next request with a 4xx and vLLM's OpenAI error body."""
        self._failures.append(_Failure("error", status, message))

    def crash_next(self, status: int = 500, message: str = "engine error") -> None:
        """Answer the next request with a 5xx, as a failing engine does."""
        self._failures.append(_Failure("error", status, message))

    def omit_kv_transfer_params_next(self) -> None:
        """Answer the next prefill leg without ``kv_transfer_params``."""
        self._failures.append(_Failure("omit_kv_transfer_params"))

    def answer_next_with(
        self, status: int, body: bytes, content_type: bytes = b"application/json"
    ) -> None:
        """Answer the next request with exactly these bytes (garbage included)."""
        self._failures.append(_Failure("raw", status, body=body, content_type=content_type))

    def break_next(self, after_events: int = 1) -> None:
        """Cut the next answer off: a stream after ``after_events`` events, a
        JSON answer halfway through its announced ``Content-Length``."""
        self._failures.append(_Failure("break", after_events=after_events))

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
        self.url = f"{scheme}://{_netloc(host)}"
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
        return _json(
            {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "owned_by": "vllm", "root": self.model}
                ],
            }
        )

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

        failure = self._failures.pop(0) if self._failures else None
        if failure is not None and failure.kind == "error":
            return _vllm_error(request, failure.status, failure.message)
        if failure is not None and failure.kind == "raw":
            request.setResponseCode(failure.status)
            request.setHeader(b"Content-Type", failure.content_type)
            return failure.body

        prompt_tokens = _prompt_tokens(body, chat)
        cached = 0
        kv_answer: JSONObject | None = None
        if role == "prefill" and (failure is None or failure.kind != "omit_kv_transfer_params"):
            request_id = _header(request, b"x-request-id") or uuid.uuid4().hex
            kv_answer = self.ledger.issue(self.name, request_id, prompt_tokens, self._kv_port)
        elif role == "decode":
            problem = self.ledger.redeem(kv)
            if problem is not None:
                return _vllm_error(request, 500, f"KV load failed: {problem}")
            cached = int(kv.get("remote_prefill_cached_tokens", 0))

        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        count = self.tokens if not isinstance(limit, int) else min(self.tokens, limit)
        words = _words(self.text, count)
        answer = _Answer(
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
        broken = failure is not None and failure.kind == "break"
        if not body.get("stream") and self._hold_after is not None and not self._hold_midway:
            await self._wait_at_hold()
        if not body.get("stream"):
            whole = answer.whole()
            if kv_answer is not None:
                whole["kv_transfer_params"] = kv_answer
            raw = _json(whole)
            if self._hold_after is not None and self._hold_midway:
                request.setHeader(b"Content-Length", str(len(raw)).encode("ascii"))
                request.write(raw[: len(raw) // 2])
                await self._wait_at_hold()
                request.write(raw[len(raw) // 2 :])
                return None
            if not broken:
                return raw
            request.setHeader(b"Content-Length", str(len(raw)).encode("ascii"))
            request.write(raw[: len(raw) // 2])
            await _cut_off(request)
            return None
        if self._firehose is not None:
            await self._pour(request, *self._firehose)
            return None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = answer.events(include_usage)
        if broken:
            assert failure is not None
            await self._stream(request, events[: failure.after_events])
            await _cut_off(request)
            return None
        await self._stream(request, events)
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


@dataclass
class _Answer:
    chat: bool
    model: str
    words: list[str]
    finish_reason: str
    usage: JSONObject
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def whole(self) -> JSONObject:
        text = "".join(self.words)
        if self.chat:
            choice: JSONObject = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": self.finish_reason,
            }
            kind = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": self.finish_reason,
            }
            kind = "text_completion"
        return {
            "id": self._prefixed_id(),
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }

    def _prefixed_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def _chunk(self, choice: JSONObject, usage: JSONObject | None = None) -> bytes:
        event: JSONObject = {
            "id": self._prefixed_id(),
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if usage is not None:
            event["usage"] = usage
        return b"data: " + _json(event) + b"\n\n"

    def events(self, include_usage: bool) -> list[bytes]:
        events = []
        if self.chat:
            events.append(
                self._chunk(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                )
            )
        for index, word in enumerate(self.words):
            last = index == len(self.words) - 1
            finish = self.finish_reason if last else None
            if self.chat:
                choice: JSONObject = {
                    "index": 0,
                    "delta": {"content": word},
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": word, "logprobs": None, "finish_reason": finish}
            events.append(self._chunk(choice))
        if include_usage:
            events.append(self._chunk({}, self.usage))
        events.append(b"data: [DONE]\n\n")
        return events


async def _cut_off(request: Request) -> None:
    """Close the connection mid-answer, as a crashing backend would."""
    if request.channel is None:
        return
    lost: Deferred[None] = request.notifyFinish()
    request.channel.loseConnection()
    with contextlib.suppress(Exception):
        await lost


def _json(value: object) -> bytes:
    return json.dumps(value).encode("utf-8")


def _header(request: Request, name: bytes) -> str | None:
    values = request.requestHeaders.getRawHeaders(name)
    return values[0].decode("ascii") if values else None


def _vllm_error(request: Request, status: int, message: str) -> bytes:
    """vLLM's error answer: OpenAI's body, with the status as ``code``."""
    request.setResponseCode(status)
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return _json({"error": {"message": message, "type": kind, "param": None, "code": status}})


def _prompt_tokens(body: JSONObject, chat: bool) -> int:
    if chat:
        text = " ".join(
            str(m.get("content", "")) for m in body.get("messages", []) if isinstance(m, dict)
        )
    else:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        text = json.dumps(prompt) if not isinstance(prompt, str) else prompt
    return max(1, len(text.split()))


def _words(text: str, count: int) -> list[str]:
    words = text.split()
    return [words[i % len(words)] + " " for i in range(count)]


@dataclass
class FakePair:
    """A fake prefill and a fake decode sharing one ledger."""

    prefill: FakeVLLM
    decode: FakeVLLM

    def stop(self) -> Deferred[Any]:
        from twisted.internet.defer import gatherResults

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


def _netloc(address: IPv4Address | IPv6Address) -> str:
    """``host:port`` for a URL, an IPv6 host in brackets."""
    if isinstance(address, IPv6Address):
        return f"[{address.host}]:{address.port}"
    return f"{address.host}:{address.port}"


def start_proxy(
    prefill: Sequence[str],
    decode: Sequence[str],
    extra_args: Sequence[str] = (),
    listen: str = "tcp:0:interface=127.0.0.1",
    clock: IReactorTime | None = None,
) -> RunningProxy:
    """Build the proxy exactly as ``twistd nixlproxy`` would, and start it.

    ``extra_args`` are more ``twistd nixlproxy`` options. A ``clock`` (such
    as ``twisted.internet.task.Clock``) drives its timeouts, backoffs and
    health checks, so a test can advance time by hand. Stop it with
    :meth:`RunningProxy.stop` (a trial ``addCleanup`` is the usual place).
    """
    from nixl_twisted.tap import ListenService, build

    args = ["--listen", listen]
    for url in prefill:
        args += ["--prefill", url]
    for url in decode:
        args += ["--decode", url]
    service = build([*args, *extra_args], clock=clock, handle_sigterm=False)
    service.startService()
    listener = next(s for s in service if isinstance(s, ListenService))
    assert listener.port is not None
    host = listener.port.getHost()
    assert isinstance(host, IPv4Address | IPv6Address)
    return RunningProxy(service, f"http://{_netloc(host)}", listener.site)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m nixl_twisted.testing``: serve a fake prefill/decode pair."""
    import argparse

    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    parser = argparse.ArgumentParser(description="Serve a fake vLLM prefill/decode pair.")
    parser.add_argument("--prefill-listen", default="tcp:8100:interface=127.0.0.1")
    parser.add_argument("--decode-listen", default="tcp:8200:interface=127.0.0.1")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--token-interval", type=float, default=0.05)
    args = parser.parse_args(argv)

    async def serve() -> None:
        pair = await start_pair(
            reactor,
            args.prefill_listen,
            args.decode_listen,
            tokens=args.tokens,
            token_interval=args.token_interval,
        )
        print(f"fake prefill listening on {pair.prefill.url}", flush=True)
        print(f"fake decode listening on {pair.decode.url}", flush=True)

    def failed(failure: Any) -> None:
        print(f"fake vLLM could not start: {failure.getErrorMessage()}", file=sys.stderr)
        reactor.stop()

    reactor.callWhenRunning(lambda: ensureDeferred(serve()).addErrback(failed))
    reactor.run()


if __name__ == "__main__":
    main()
