"""The in-memory layer: the proxy's whole tree, fakes in memory, time on a Clock."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock

from nixl_twisted.config import ProxyConfig
from nixl_twisted.testing import FakeVLLM, InMemoryClient, InMemoryProxy, TransferLedger

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
STREAM: dict[str, Any] = dict(CHAT, stream=True)
#: The default timeouts, which these tests run with.
TIMEOUTS = ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"]).timeouts


class Setup:
    """One fake prefill, one fake decode and a proxy before them, all in memory."""

    def __init__(self, tokens: int = 4, **settings: object) -> None:
        self.ledger = TransferLedger()
        self.clock = Clock()
        self.prefill = FakeVLLM(name="prefill-0", ledger=self.ledger, tokens=tokens)
        self.decode = FakeVLLM(name="decode-0", ledger=self.ledger, tokens=tokens)
        self.proxy = InMemoryProxy([self.prefill], [self.decode], self.clock, **settings)

    def post(self, path: str, body: object) -> InMemoryClient:
        raw = json.dumps(body).encode("utf-8")
        return self.proxy.request("POST", path, raw, {"Content-Type": "application/json"})

    def phase(self) -> str:
        (exchange,) = self.proxy.app.exchanges
        return exchange.phase.value


def status(client: InMemoryClient) -> int:
    return client.answer().status


def error_code(client: InMemoryClient) -> str:
    return str(client.answer().json()["error"]["code"])


def sse_events(client: InMemoryClient) -> list[Any]:
    """The JSON payloads of an SSE body, ``[DONE]`` as the string."""
    events: list[Any] = []
    for line in client.answer().body.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].strip()
            events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return events
