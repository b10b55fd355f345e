"""OpenAI's Responses API in two legs, through the official openai client over HTTP.

Follow-ups routed to the instance that holds a response, and the refusals,
are proved in memory (``tests/memory/test_responses.py``).
"""

from __future__ import annotations

from openai import OpenAI
from twisted.internet.threads import deferToThread

from tests.support import ProxyCase


class ResponsesTests(ProxyCase):
    def client(self) -> OpenAI:
        return OpenAI(base_url=self.proxy.url + "/v1", api_key="k", max_retries=0)

    async def test_a_response_goes_through_both_legs(self) -> None:
        await self.start(tokens=5)
        answer = await deferToThread(
            lambda: self.client().responses.create(
                model="m", input="What is NIXL?", max_output_tokens=5
            )
        )
        self.assertEqual(answer.output_text.split(), self.decode.text.split()[:5])
        (prefill,) = self.prefill.requests_for("prefill")
        assert prefill.body is not None
        lowered = {
            k: prefill.body[k] for k in ("max_output_tokens", "stream", "store", "background")
        }
        self.assertEqual(
            lowered, {"max_output_tokens": 1, "stream": False, "store": False, "background": False}
        )
        (decode,) = self.decode.requests_for("decode")
        assert decode.body is not None
        self.assertEqual(decode.body["max_output_tokens"], 5)

    async def test_a_streamed_response_keeps_its_typed_events(self) -> None:
        await self.start(tokens=3)

        def stream() -> list[str]:
            events = self.client().responses.create(model="m", input="hi", stream=True)
            return [event.type for event in events]

        types = await deferToThread(stream)
        self.assertEqual(types[0], "response.created")
        self.assertEqual(types[-1], "response.completed")
        self.assertEqual(types.count("response.output_text.delta"), 3)
