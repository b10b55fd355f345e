"""``FakeVLLM``: one fake vLLM instance, playing prefill and decode as NIXL-enabled vLLM does.

Like a real instance started with the NixlConnector, it decides its role per
request from ``kv_transfer_params``: ``do_remote_decode`` (a prefill leg)
answers one token and params recorded in a shared ``TransferLedger``;
``do_remote_prefill`` (a decode leg) checks the params are exactly ones a
prefill issued (a KV-load failure, 500, if not) and generates; anything
else generates as a plain instance. It serves on its own ``Site``, never
the proxy's, so a proxy bug cannot hide on both sides of a test.

Here are its knobs, its serving and its route table; how it answers a
generation request is ``generation``, its other routes ``routes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from klein import Klein
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IReactorTime
from twisted.web.server import Request

from nixl_twisted.testing.bidirectional import Bidirectional
from nixl_twisted.testing.capacity import Capacity
from nixl_twisted.testing.controls import Controls
from nixl_twisted.testing.engine import EngineTime
from nixl_twisted.testing.faults import Fault
from nixl_twisted.testing.generation import Generation
from nixl_twisted.testing.kv_publisher import KvEventsMixin
from nixl_twisted.testing.ledger import TransferLedger
from nixl_twisted.testing.prefix_cache import PrefixCache
from nixl_twisted.testing.received import ReceivedRequest
from nixl_twisted.testing.routes import OtherRoutes
from nixl_twisted.testing.site import FakeSite, netloc
from nixl_twisted.testing.transfers import PromptSources

JSONObject = dict[str, Any]

DEFAULT_TEXT = (
    "Hello from the fake decode instance: these tokens were prefilled on one "
    "instance, moved over NIXL and generated on another, all through nixl-twisted."
)
#: The tokens of ``DEFAULT_TEXT``, once: an answer of this many ends on its full stop.
SENTENCE_TOKENS = len(DEFAULT_TEXT.split())


@dataclass
class FakeVLLM(Generation, Bidirectional, OtherRoutes):
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

    With ``bidirectional`` (set it on the prefills and decodes of a test), a
    decode leg that ends answers a handle on its blocks, pinned for
    ``decoder_blocks_ttl`` on ``clock`` (in a non-streaming chat or
    completions body and in ``/v1/responses``; with ``streams_handle``, as
    vLLM 0.33+, also in a stream's chunk that carries ``finish_reason``),
    and a prefill leg given one reads it back (``bidirectional``).
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
    #: Bidirectional transfer (vLLM's ``bidirectional_kv_xfer``): a decode leg's handle,
    #: a prefill leg's read of one. Off: a handle is a prefill leg's params like any other.
    bidirectional: bool = False
    #: Seconds on ``clock`` a handle's blocks stay pinned (``decoder_kv_blocks_ttl``).
    decoder_blocks_ttl: float = 480.0
    #: A stream's chunk that carries ``finish_reason`` carries the handle (vLLM 0.33+).
    streams_handle: bool = False
    #: What a prefill leg does with a handle it cannot read (expired, or none issued it):
    #: ``fail`` (vLLM's default: 500) or ``recompute`` (computes the prompt, answers 200).
    kv_load_failure_policy: str = "fail"
    #: A prefill leg computes instead of pulling fewer than this many tokens through a
    #: handle (vLLM's ``kv_recompute_threshold``, 64 there; 0 here: every pull is made).
    kv_recompute_threshold: int = 0
    #: The handles this decode answered, and those this prefill read (each a dict:
    #: ``handle``, ``pulled`` tokens, read ``again``, whether the prompt ``extends`` it).
    handles_issued: list[JSONObject] = field(default_factory=list)
    handles_read: list[JSONObject] = field(default_factory=list)
    #: How this instance fails every generation request (None: it serves them):
    #: set it on one instance of a pool, and back to None to heal it.
    fault: Fault | None = None

    #: Every fake's routes, made once (werkzeug compiles each rule, which takes
    #: longer than a test in memory); Klein binds them to each fake.
    routes: ClassVar[Klein] = Klein()

    def __post_init__(self) -> None:
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(
                f"kv_load_failure_policy is fail or recompute, not {self.kv_load_failure_policy!r}"
            )
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
