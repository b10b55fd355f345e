"""A decode instance killed mid-stream (a real process, SIGKILL): the answer goes on on another.

Two processes of fakes (``python -m nixl_twisted.testing``), each a prefill and a decode on a
ledger of its own: the first one's decode stops after some tokens and is killed there; the
proxy moves the stream to the other process's pair, and the client's answer is the one that
pair gives uninterrupted, token for token, its usage whole, one ``[DONE]``.
"""

from __future__ import annotations

import os
import re
import signal

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from nixl_twisted.testing.process import WatchedProcess
from tests.process.support import TwistdCase
from tests.support import ChunkCollector, assert_same_answer

#: Tokens relayed before the kill (a chat stream's role first).
RELAYED = 3
CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "What does decode pull over NIXL?"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0,
}
COMPLETION = {
    "model": "fake-model",
    "prompt": "What does decode pull over NIXL?",
    "max_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0,
}
#: How a token's event starts, by route.
TOKENS = {"/v1/chat/completions": b'"delta":{"content"', "/v1/completions": b'"text"'}


class Until(ChunkCollector):
    """A streamed body, and a Deferred that fires once ``count`` tokens arrived."""

    def __init__(self, count: int, token: bytes) -> None:
        super().__init__()
        self.count = count
        self.token = token
        self.reached: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        super().dataReceived(data)
        if not self.reached.called and self.body.count(self.token) >= self.count:
            self.reached.callback(None)


class DecodeKilledTests(TwistdCase):
    timeout = 60

    async def pair(self, *more: str) -> tuple[WatchedProcess, dict[str, str]]:
        """A prefill and a decode in a process of their own, on ports the OS picks."""
        process = self.spawn_fakes(
            *("--prefill-port", "0", "--decode-port", "0", "--tokens", "8"),
            *("--token-interval", "0", *more),
        )
        await process.line_with(b"twistd -n ")  # printed once both listen
        return process, dict(re.findall(r"fake (\S+) listening on (\S+)", process.output.decode()))

    async def moved(self, path: str, body: dict[str, object], relayed: int) -> None:
        """``body`` streamed through a proxy whose first decode is killed after ``relayed``
        tokens: the answer the other pair gives uninterrupted, the move in the access event."""
        events = relayed + (1 if path == "/v1/chat/completions" else 0)  # (a chat's role first)
        doomed, a = await self.pair("--decode-hold-after", str(events))
        _, b = await self.pair()
        self.clock = Clock()  # (the proxy's timers: none runs out in this test)
        proxy = self.start_proxy([a["prefill-0"], b["prefill-0"]], [a["decode-0"], b["decode-0"]])
        access = self.access_events()
        http = self.fresh_connections()

        response = await http.post(proxy.url + path, json=body)
        self.assertEqual(response.code, 200)
        stream = Until(relayed, TOKENS[path])
        response.deliverBody(stream)
        await stream.reached  # its decode holds there, the client has ``relayed`` tokens
        os.kill(doomed.transport.pid, signal.SIGKILL)  # type: ignore[union-attr]
        self.assertEqual(await doomed.ended, None)
        self.assertEqual(doomed.signal, signal.SIGKILL)
        moved = b"".join(await stream.done)

        again = await http.post(proxy.url + path, json=body)
        whole = await again.content()  # (the pair left, uninterrupted)
        assert_same_answer(moved, whole)
        self.assertEqual(moved.count(b"data: [DONE]"), 1)
        self.assertIn(b'"usage":{"prompt_tokens"', moved)
        (moves,) = access[0]["migrations"]
        self.assertRegex(
            moves, rf"^{a['decode-0']}@{relayed} -> {b['decode-0']} completed \(\d+ ms\)$"
        )

    async def test_a_chat_stream_killed_after_k_tokens_goes_on_elsewhere_token_for_token(
        self,
    ) -> None:
        await self.moved("/v1/chat/completions", CHAT, RELAYED)

    async def test_a_text_completion_stream_killed_after_k_tokens_goes_on_token_for_token(
        self,
    ) -> None:
        await self.moved("/v1/completions", COMPLETION, RELAYED)
