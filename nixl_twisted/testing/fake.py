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

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from klein import Klein
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IReactorTime
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from nixl_twisted.testing import answers, prompt_ids, schema
from nixl_twisted.testing.behaviours import Behaviour, spoiled
from nixl_twisted.testing.capacity import QUEUE_FULL, QUEUE_FULL_TYPE, Capacity
from nixl_twisted.testing.controls import Controls
from nixl_twisted.testing.engine import EngineTime
from nixl_twisted.testing.kv_publisher import KvEventsMixin
from nixl_twisted.testing.ledger import TransferLedger
from nixl_twisted.testing.prefix_cache import PrefixCache, prompt_tokens
from nixl_twisted.testing.routes import OtherRoutes
from nixl_twisted.testing.site import FakeSite, cut_off, netloc
from nixl_twisted.testing.transfers import PromptSources

JSONObject = dict[str, Any]

DEFAULT_TEXT = (
    "Hello from the fake decode instance: these tokens were prefilled on one "
    "instance, moved over NIXL and generated on another, all through nixl-twisted."
)
#: The tokens of ``DEFAULT_TEXT``, once: an answer of this many ends on its full stop.
SENTENCE_TOKENS = len(DEFAULT_TEXT.split())


@dataclass
class ReceivedRequest:
    """One request as the fake saw it (``carried_kv_transfer_params``: the body had the key)."""

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

    @property
    def carried_kv_transfer_params(self) -> bool:
        """Whether the body had a ``kv_transfer_params`` key, whatever its value (``null`` too).

        A decode-only request must carry none: vLLM then computes the prompt itself.
        """
        return isinstance(self.body, dict) and "kv_transfer_params" in self.body

    @property
    def handed_token_ids(self) -> object:
        """``kv_transfer_params.prompt_token_ids`` as sent (None: none were handed)."""
        kv = self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None
        return kv.get("prompt_token_ids") if isinstance(kv, dict) else None

    @property
    def connector_params(self) -> object:
        """``kv_transfer_params`` as vLLM's NIXL connector sees them: without the prompt's
        token ids, which vLLM takes out first (what the ledger redeems)."""
        kv = self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None
        if not isinstance(kv, dict):
            return kv
        return {key: value for key, value in kv.items() if key != "prompt_token_ids"}


@dataclass
class FakeVLLM(Capacity, Controls, EngineTime, KvEventsMixin, OtherRoutes):
    """A fake vLLM instance; ``tokens`` per answer, ``token_interval`` s apart.

    Its engine takes time only when told to, each wait on ``clock``: a
    prompt computed here (a prefill leg, or a plain request such as a
    decode-only one) costs ``prefill_cost_per_token`` per token its prefix
    cache lacks; a decode leg pulls the prompt's KV first
    (``kv_load_latency`` plus ``kv_load_cost_per_token`` per prompt token);
    with ``computing_stalls_streams``, a compute holds back the next token
    of every stream on this instance until it ends, as vLLM runs a prefill
    in the same engine step as the decodes.

    Its capacity is unlimited unless told: with ``max_num_seqs``, at most that
    many generation requests run at once and the rest wait, first come first
    served, as in vLLM's waiting queue; with ``max_num_queued_reqs``, one more
    than that many waiting or running is refused with vLLM's 503.

    With ``kv_events``, what its prefix cache stores and evicts is published
    as vLLM's KV cache events, on ZeroMQ (``kv_publisher``).
    """

    name: str = "fake-vllm"
    ledger: TransferLedger = field(default_factory=TransferLedger)
    tokens: int = 8
    token_interval: float = 0.0
    model: str = "fake-model"
    #: LoRA adapters it serves besides ``model``: ``/v1/models`` lists each, as vLLM does.
    adapters: tuple[str, ...] = ()
    #: The model's context, as its ``/v1/models`` card and ``/tokenize`` say it.
    max_model_len: int = 1024
    text: str = DEFAULT_TEXT
    clock: IReactorTime | None = None
    requests: list[ReceivedRequest] = field(default_factory=list)
    #: Generation requests received (prefill and decode legs, plain requests).
    generations: int = 0
    #: Streams whose client went away before the stream ended.
    disconnects: int = 0
    #: Decode legs whose engine took the prompt's token ids handed in
    #: ``kv_transfer_params`` instead of rendering and tokenizing the prompt.
    token_ids_reused: int = 0
    #: Answers ``return_token_ids`` (False: as a vLLM too old to know it, which ignores it).
    returns_token_ids: bool = True
    #: Headers added to every generation answer, e.g. to test header rules.
    extra_headers: dict[str, str] = field(default_factory=dict)
    #: ``GET /health`` checks received, and the status they are answered with.
    health_checks: int = 0
    health_status: int = 200
    #: ``GET /v1/models`` from the proxy's health loop (not in ``requests``), and
    #: whether those go unanswered.
    model_reads: int = 0
    models_stalled: bool = False
    #: The status ``GET /metrics`` answers (500: vLLM's metrics unreadable).
    metrics_status: int = 200
    #: Generation requests that run at once (vLLM's ``--max-num-seqs``); the rest
    #: wait their turn, first come first served. 0: no limit.
    max_num_seqs: int = 0
    #: Requests waiting or running past which one more is refused, 503 (vLLM's
    #: ``--max-num-queued-reqs``). None: no limit.
    max_num_queued_reqs: int | None = None
    #: The requests ``GET /metrics`` says are waiting: those waiting for a slot
    #: (``max_num_seqs``), plus what a test sets it to.
    waiting: int = 0
    #: Seconds of prefill per prompt token not found in the prefix cache (on ``clock``).
    prefill_cost_per_token: float = 0.0
    #: While a prompt is computed here, no stream of this instance writes its
    #: next event (each stream's first event is its own: it comes after its
    #: own compute or KV pull). Off: computes and streams run side by side.
    computing_stalls_streams: bool = False
    #: Seconds per prompt token a decode leg (``do_remote_prefill``) waits
    #: before its first token, pulling the KV: every prompt token, counted as
    #: the prefix cache counts them (this fake's own cache is not looked up
    #: for a decode leg, and what the prefill had cached moves all the same).
    kv_load_cost_per_token: float = 0.0
    #: Seconds every KV pull waits besides, whatever its size (NIXL's handshake).
    kv_load_latency: float = 0.0
    #: The prefix cache: tokens per block, blocks kept (LRU).
    block_tokens: int = 128
    cache_blocks: int = 4096
    #: Publish the prefix cache's KV events (vLLM's ``--kv-events-config``) on a
    #: free port of ``kv_interface`` once listening, and (``kv_replay``) answer replays.
    kv_events: bool = False
    kv_replay: bool = False
    kv_topic: bytes = b"kv"
    kv_buffer_steps: int = 10_000
    kv_interface: str = "127.0.0.1"
    #: The status the render endpoints answer (vLLM without ``--enable-scale-out``: 404).
    render_status: int = 200
    #: The status ``GET /kv_event_sources`` answers (its publisher, when 200).
    kv_sources_status: int = 200
    #: A decode leg ignores its ``kv_transfer_params`` and computes the prompt itself,
    #: counted as ``local_compute`` and answered as usual: vLLM when the handoff fails.
    recompute_silently: bool = False
    #: Its prompt tokens by source and NIXL failures, as ``/metrics`` says them.
    sources: PromptSources = field(default_factory=PromptSources)

    #: Every fake's routes, made once (werkzeug compiles each rule, which takes
    #: longer than a test in memory); Klein binds them to each fake.
    routes: ClassVar[Klein] = Klein()

    def __post_init__(self) -> None:
        Capacity.__init__(self)
        Controls.__init__(self)
        EngineTime.__init__(self)
        KvEventsMixin.__init__(self)
        self._port: IListeningPort | None = None
        #: The fake's site: its open connections, and how many it accepted.
        self.site = FakeSite(self.resource())
        self.url = ""
        self._kv_port = 5600
        self.cache = PrefixCache(self.block_tokens, self.cache_blocks, on_events=self._kv_changed)
        #: Generation requests holding a slot now (``vllm:num_requests_running``),
        #: plus what a test sets it to.
        self.running = 0
        #: The Responses API answers this instance produced, by id (as vLLM stores them).
        self.responses: dict[str, JSONObject] = {}

    def requests_for(self, role: str) -> list[ReceivedRequest]:
        return [r for r in self.requests if r.role == role]

    # -- serving -----------------------------------------------------------

    async def listen(
        self, description: str = "tcp:0:interface=127.0.0.1", reactor: Any = None
    ) -> str:
        """Serve on a Twisted endpoint (and publish KV events, if told); return the base URL."""
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        if self.clock is None:
            self.clock = reactor
        self._port = await serverFromString(reactor, description).listen(self.site)
        try:
            self._start_kv_events(reactor)
        except BaseException:
            port, self._port = self._port, None
            await maybeDeferred(port.stopListening)
            raise
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
        port, self._port = self._port, None
        self._stop_kv_events()
        return self.site.stop(port)

    def resource(self) -> Any:
        """The fake's HTTP resource: its routes, served by this fake."""
        return self.routes.resource()

    def _record(self, request: Request, body: JSONObject | None, role: str) -> None:
        if role != "other":
            self.generations += 1
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

    async def _generate(self, request: Request) -> bytes | None:
        try:
            return await self._answer(request)
        except CancelledError:
            # Klein cancels the handler when the client goes away (waiting or running).
            self.disconnects += 1
            raise

    async def _answer(self, request: Request) -> bytes | None:
        assert request.content is not None
        request.setHeader(b"Content-Type", b"application/json")
        try:
            body = json.loads(request.content.read())
        except (ValueError, RecursionError) as error:
            request.setResponseCode(400)
            return answers.vllm_error(400, f"the body is not JSON vLLM can read: {error}")
        if not isinstance(body, dict):
            request.setResponseCode(400)
            return answers.vllm_error(400, "Input should be a valid dictionary")
        kv = body.get("kv_transfer_params")
        role = "plain"
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            role = "prefill"
        elif isinstance(kv, dict) and kv.get("do_remote_prefill"):
            role = "decode"
        self._record(request, body, role)
        refused = schema.refusal(request.path.decode("utf-8"), body)
        if refused is not None:
            request.setResponseCode(400)
            return answers.vllm_error(400, refused)
        for name, value in self.extra_headers.items():
            request.setHeader(name.encode("ascii"), value.encode("utf-8"))

        behaviour = self._next_behaviour()
        instead = behaviour.instead()
        if instead is not None:
            status, content_type, raw = instead
            request.setResponseCode(status)
            request.setHeader(b"Content-Type", content_type)
            return raw
        if not self._admits():
            request.setResponseCode(503)
            return answers.vllm_error(503, QUEUE_FULL, QUEUE_FULL_TYPE)
        # Its compute, KV pull and tokens begin only once it runs.
        await self._take_slot()
        try:
            return await self._run(request, body, role, behaviour)
        finally:
            self._release_slot()

    async def _run(
        self, request: Request, body: JSONObject, role: str, behaviour: Behaviour
    ) -> bytes | None:
        """Serve a generation request that holds a slot: compute, pull, generate."""
        kv = body.get("kv_transfer_params")
        chat = request.path.endswith(b"/chat/completions")
        messages_api = request.path.endswith(b"/v1/messages")
        responses_api = request.path.endswith(b"/v1/responses")
        input_tokens = answers.prompt_tokens(body, chat)
        cached = 0
        tokens = prompt_tokens(body)
        if role in ("prefill", "plain"):
            # What the lookup stored and evicted is one batch, published as vLLM
            # publishes a step's events: once the step (the compute) has run.
            with self._step() as step:
                salt = body.get("cache_salt")
                cached, _ = self.cache.compute(tokens, salt if isinstance(salt, str) else None)
            self.sources.local_cache_hit += cached
            self.sources.local_compute += len(tokens) - cached
            try:
                await self._compute(len(tokens) - cached)
            finally:
                self._stepped(step)
        kv_answer: JSONObject | None = None
        if role == "prefill" and behaviour.issues_params:
            request_id = _header(request, b"x-request-id") or uuid.uuid4().hex
            kv_answer = self.ledger.issue(self.name, request_id, input_tokens, self._kv_port)
            kv_answer = spoiled(kv_answer, behaviour.spoiled)
        elif role == "decode" and self.recompute_silently:
            self.sources.local_compute += len(tokens)
            await self._compute(len(tokens))
        elif role == "decode":
            handed = prompt_ids.take(kv, body, chat or messages_api or responses_api)
            if handed.refusal is not None:
                request.setResponseCode(400)
                return answers.vllm_error(400, handed.refusal)
            kv = handed.params
            if handed.used is not None:
                tokens, self.token_ids_reused = handed.used, self.token_ids_reused + 1
            problem = self.ledger.redeem(kv)
            if problem is not None:
                request.setResponseCode(500)
                return answers.vllm_error(500, f"KV load failed: {problem}")
            self.sources.external_kv_transfer += len(tokens)
            cached = int(kv.get("remote_prefill_cached_tokens", 0)) if isinstance(kv, dict) else 0
            await self._pull_kv(len(tokens))

        limit = (
            body.get("max_output_tokens")
            if responses_api
            else body.get("max_completion_tokens") or body.get("max_tokens")
        )
        count = self.tokens if not isinstance(limit, int) else min(self.tokens, limit)
        words = answers.words(self.text, count)
        if responses_api:
            reply = answers.Response(
                model=str(body.get("model", self.model)), words=words, input_tokens=input_tokens
            )
            if role != "prefill" and body.get("store", True):
                self.responses[reply.id] = reply.whole()
            if not body.get("stream"):
                whole = reply.whole()
                if kv_answer is not None:
                    whole["kv_transfer_params"] = kv_answer
                return answers.encode(whole)
            await self._stream(request, reply.events())
            return None
        if messages_api:
            message = answers.Message(
                model=str(body.get("model", self.model)),
                words=words,
                stop_reason="max_tokens" if count == limit else "end_turn",
                input_tokens=answers.prompt_tokens(body, True),
            )
            if not body.get("stream"):
                whole = message.whole()
                if kv_answer is not None:
                    whole["kv_transfer_params"] = kv_answer
                return answers.encode(whole)
            await self._stream(request, message.events(), behaviour.cut_after)
            return None
        answer = answers.Answer(
            chat=chat,
            model=str(body.get("model", self.model)),
            words=words,
            finish_reason="length" if count == limit else "stop",
            usage={
                "prompt_tokens": input_tokens,
                "completion_tokens": len(words),
                "total_tokens": input_tokens + len(words),
                "prompt_tokens_details": {"cached_tokens": cached},
            },
            prompt_token_ids=tokens if self.returns_token_ids and prompt_ids.asked(body) else None,
        )
        if not body.get("stream"):
            return await self._whole(request, answer, kv_answer, behaviour.cut_after is not None)
        if self._firehose is not None:
            await self._pour(request, *self._firehose)
            return None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        await self._stream(request, answer.events(include_usage), behaviour.cut_after)
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
            await cut_off(request)
            return None
        await self._wait_at_hold()
        request.write(raw[len(raw) // 2 :])
        return None

    async def _stream(
        self, request: Request, events: list[bytes], cut_after: int | None = None
    ) -> None:
        """Write ``events`` as they come; ``cut_after``: that many, then a cut connection."""
        request.setHeader(b"Content-Type", b"text/event-stream")
        if cut_after is not None:
            events = events[:cut_after]
        for index, event in enumerate(events):
            if index > 0:
                await self._before_next_token()
            if self._hold_after is not None and index >= self._hold_after:
                await self._wait_at_hold()
            request.write(event)
        if cut_after is not None:
            await cut_off(request)


def _handler(name: str) -> Callable[..., Any]:
    """The fake's own method of this name, looked up per call: a subclass may override it."""

    def handle(fake: FakeVLLM, request: Request, **matched: Any) -> Any:
        return getattr(fake, name)(request, **matched)

    handle.__name__ = name  # Klein names each route's endpoint by its function
    return handle


for _path, _method, _name in (
    ("/health", "GET", "_health"),
    ("/metrics", "GET", "_metrics"),
    ("/v1/models", "GET", "_models"),
    ("/tokenize", "POST", "_tokenize"),
    ("/detokenize", "POST", "_detokenize"),
    ("/kv_event_sources", "GET", "_kv_event_sources"),
    ("/v1/completions/render", "POST", "_render"),
    ("/v1/chat/completions/render", "POST", "_render"),
    ("/v1/completions", "POST", "_generate"),
    ("/v1/chat/completions", "POST", "_generate"),
    ("/v1/messages", "POST", "_generate"),
    ("/v1/responses", "POST", "_generate"),
    ("/v1/responses/<string:response_id>", "GET", "_stored"),
    ("/v1/responses/<string:response_id>/cancel", "POST", "_stored"),
    ("/v1/messages/count_tokens", "POST", "_count_tokens"),
):
    FakeVLLM.routes.route(_path, methods=[_method])(_handler(_name))


def _header(request: Request, name: bytes) -> str | None:
    values = request.requestHeaders.getRawHeaders(name)
    return values[0].decode("ascii") if values else None
