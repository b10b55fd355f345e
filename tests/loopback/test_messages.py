"""Anthropic's Messages API in two legs, through the official anthropic client over HTTP.

The proxy's own errors and a broken stream in Anthropic's shapes are proved
in memory (``tests/memory/test_messages.py``).
"""

from __future__ import annotations

from typing import Any

import anthropic
from twisted.internet.threads import deferToThread

from tests.support import ProxyCase

ASK: dict[str, Any] = {
    "model": "m",
    "max_tokens": 6,
    "messages": [{"role": "user", "content": "What does decode pull over NIXL?"}],
}


class MessagesTests(ProxyCase):
    def client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.proxy.url, api_key="k", max_retries=0)

    async def test_a_message_goes_through_both_legs(self) -> None:
        await self.start(tokens=6)
        message = await deferToThread(lambda: self.client().messages.create(**ASK))
        self.assertEqual(message.content[0].text.split(), self.decode.text.split()[:6])
        (prefill,) = self.prefill.requests_for("prefill")
        assert prefill.body is not None
        self.assertEqual((prefill.body["max_tokens"], prefill.body["stream"]), (1, False))
        (decode,) = self.decode.requests_for("decode")
        assert decode.body is not None
        self.assertEqual(decode.body["max_tokens"], 6)  # the client's, verbatim
        self.assertEqual(len(self.ledger.redeemed), 1)

    async def test_a_streamed_message_is_relayed_event_by_event(self) -> None:
        await self.start(tokens=4)

        def stream() -> list[str]:
            with self.client().messages.stream(**ASK) as events:
                return [event.type for event in events]

        types = await deferToThread(stream)
        self.assertEqual(types[0], "message_start")
        self.assertEqual(types[-1], "message_stop")
        self.assertEqual(types.count("content_block_delta"), 4)

    async def test_count_tokens_is_one_leg_to_decode(self) -> None:
        await self.start()
        count = await deferToThread(
            lambda: self.client().messages.count_tokens(model="m", messages=ASK["messages"])
        )
        self.assertGreater(count.input_tokens, 0)
        self.assertEqual(self.prefill.requests, [])
