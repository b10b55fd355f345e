"""OpenAI's Responses API in two legs, through the official openai client."""

from __future__ import annotations

import json

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
        self.assertEqual(lowered, {"max_output_tokens": 1, "stream": False, "store": False,
                                   "background": False})  # fmt: skip
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

    async def test_follow_ups_go_to_the_decode_instance_that_holds_the_response(self) -> None:
        await self.start(decodes=3)
        made = [await deferToThread(lambda: self.client().responses.create(model="m", input="x"))
                for _ in range(3)]  # fmt: skip
        client = self.client()
        for answer in made:
            again = await deferToThread(client.responses.retrieve, answer.id)
            self.assertEqual(again.id, answer.id)
        for decode in self.decodes:  # each asked only for what it made
            asked = [r.path for r in decode.requests if r.role == "other"]
            self.assertEqual(asked, [f"/v1/responses/{i}" for i in decode.responses])

    async def test_an_unknown_response_is_asked_of_each_decode_then_404(self) -> None:
        await self.start(decodes=2)
        held = await deferToThread(lambda: self.client().responses.create(model="m", input="x"))
        self.proxy.app.responses_seen = type(self.proxy.app.responses_seen)()  # a restart
        response = await self.http.get(self.proxy.url + f"/v1/responses/{held.id}")
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(await response.content())["id"], held.id)
        missing = await self.http.post(self.proxy.url + "/v1/responses/resp_nope/cancel")
        self.assertEqual(missing.code, 404)
        await missing.content()
        self.assertEqual(sum(1 for d in self.decodes for r in d.requests
                             if r.path.endswith("resp_nope/cancel")), 2)  # fmt: skip

    async def test_what_two_engines_cannot_do_is_a_400_before_any_backend(self) -> None:
        await self.start()
        for body, code in (
            ({"model": "m", "input": "x", "previous_response_id": "resp_1"},
             "previous_response_id_unsupported"),
            ({"model": "m", "input": "x", "background": True}, "background_unsupported"),
        ):  # fmt: skip
            response, answer = await self.post_json("/v1/responses", body)
            self.assertError(response, answer, 400, code)
        self.assertEqual(self.prefill.requests, [])
