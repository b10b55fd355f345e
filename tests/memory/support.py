"""The in-memory layer: the proxy's whole tree, fakes in memory, time on a Clock."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from nixl_twisted.config import ProxyConfig
from nixl_twisted.testing import FakeVLLM, InMemoryClient, InMemoryProxy, TransferLedger
from nixl_twisted.testing.memory import Answer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

T = TypeVar("T")

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
STREAM: dict[str, Any] = dict(CHAT, stream=True)
#: The chat body of the end-to-end tests: fields the proxy does not own, to pass untouched.
FULL_CHAT: dict[str, Any] = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello there"}],
    "temperature": 1.0,
    "reasoning_effort": "high",
    "chat_template_kwargs": {"enable_thinking": True},
}
#: The default timeouts, which these tests run with.
TIMEOUTS = ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"]).timeouts
#: A scraped sample's key: its name and its labels, sorted.
Sample = tuple[str, tuple[tuple[str, str], ...]]


class Setup:
    """Fake prefills and decodes sharing a ledger, and a proxy before them, all in memory.

    ``fake_options`` are ``FakeVLLM``'s (``extra_headers``, ...); ``settings``
    the proxy's, by name, as ``InMemoryProxy`` takes them.
    """

    def __init__(
        self,
        tokens: int = 8,
        prefills: int = 1,
        decodes: int = 1,
        fake_options: dict[str, Any] | None = None,
        tracer_provider: TracerProvider | None = None,
        start: bool = True,
        **settings: object,
    ) -> None:
        self.ledger = TransferLedger()
        self.clock = Clock()
        options = dict(fake_options or {}, tokens=tokens, ledger=self.ledger)
        self.prefills = [FakeVLLM(name=f"prefill-{i}", **options) for i in range(prefills)]
        self.decodes = [FakeVLLM(name=f"decode-{i}", **options) for i in range(decodes)]
        self.proxy = InMemoryProxy(
            self.prefills,
            self.decodes,
            self.clock,
            tracer_provider=tracer_provider,
            start=start,
            **settings,
        )

    @property
    def prefill(self) -> FakeVLLM:
        return self.prefills[0]

    @property
    def decode(self) -> FakeVLLM:
        return self.decodes[0]

    def post(
        self, path: str, body: object, headers: dict[str, str] | None = None
    ) -> InMemoryClient:
        """POST ``body`` (bytes as they are, anything else as JSON) as a JSON request."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        sent = {"Content-Type": "application/json", **(headers or {})}
        return self.proxy.request("POST", path, raw, sent)

    def get(self, path: str, headers: dict[str, str] | None = None) -> InMemoryClient:
        return self.proxy.request("GET", path, b"", headers)

    def phase(self) -> str:
        (exchange,) = self.proxy.app.serving.exchanges
        return exchange.phase.value

    def settle(self, waiting: Deferred[T]) -> T:
        """What ``waiting`` fired with, once every byte in memory has moved (it must fire)."""
        self.proxy.flush()
        outcome: list[T | Failure] = []
        waiting.addBoth(outcome.append)
        assert outcome, f"{waiting!r} has not fired"
        if isinstance(outcome[0], Failure):
            outcome[0].raiseException()
        return outcome[0]

    def new_fake(self, name: str) -> FakeVLLM:
        """Another fake on the same ledger, served in memory (for the admin API to add)."""
        fake = FakeVLLM(name=name, ledger=self.ledger)
        self.proxy.serve(fake)
        return fake

    def held_stream(
        self,
        fake: FakeVLLM | None = None,
        after: int = 1,
        path: str = "/v1/chat/completions",
        body: object = None,
    ) -> InMemoryClient:
        """A streaming request whose decode holds after ``after`` events.

        Returns once the fake holds the stream; ``fake.release()`` lets it go on.
        """
        fake = fake or self.decode
        fake.hold_streams_after(after)
        held = fake.stream_held()
        client = self.post(path, body if body is not None else dict(FULL_CHAT, stream=True))
        assert held.called, "the stream never reached its hold point"
        return client

    def metrics(self) -> str:
        """``GET /metrics``, as text."""
        answer = self.get("/metrics").answer()
        assert answer.status == 200
        assert answer.headers["content-type"].startswith("text/plain")
        return answer.body.decode()

    def scrape(self) -> dict[Sample, float]:
        """Every sample ``GET /metrics`` shows, by name and labels."""
        samples = {}
        for family in text_string_to_metric_families(self.metrics()):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples


def status(client: InMemoryClient) -> int:
    return client.answer().status


def error_code(client: InMemoryClient) -> str:
    return str(client.answer().json()["error"]["code"])


def assert_error(answer: Answer, status: int, code: str) -> None:
    """An OpenAI-style error body with the status and code expected."""
    assert answer.status == status, (answer.status, answer.body)
    assert answer.values("content-type") == ["application/json"]
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]


def sse_events(client: InMemoryClient) -> list[Any]:
    """The JSON payloads of an SSE body, ``[DONE]`` as the string."""
    return sse_payloads(client.answer().body)


def sse_payloads(body: bytes) -> list[Any]:
    """The JSON payloads of the SSE events in ``body``, ``[DONE]`` as the string."""
    events: list[Any] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].strip()
            events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return events
