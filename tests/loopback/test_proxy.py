"""The proxy end to end on loopback: fake prefill and decode, real sockets."""

from __future__ import annotations

import json

from twisted.internet.defer import gatherResults

from nixl_twisted.protocol.lowering import prefill_kv_transfer_params
from tests.support import CHAT, ChunkCollector, ProxyCase, sse_events


class TwoLegsTests(ProxyCase):
    async def test_chat_goes_through_prefill_then_decode(self) -> None:
        await self.start()
        response, answer = await self.post_json("/v1/chat/completions", CHAT)

        self.assertEqual(response.code, 200)
        self.assertEqual(answer["object"], "chat.completion")
        self.assertTrue(answer["choices"][0]["message"]["content"])
        (prefill,) = self.prefill.requests
        (decode,) = self.decode.requests
        self.assertEqual((prefill.role, prefill.path), ("prefill", "/v1/chat/completions"))
        self.assertEqual((decode.role, decode.path), ("decode", "/v1/chat/completions"))
        # Fields the proxy does not own pass through both legs untouched.
        for key in ("model", "messages", "temperature", "reasoning_effort", "chat_template_kwargs"):
            self.assertEqual(prefill.body[key], CHAT[key])  # type: ignore[index]
            self.assertEqual(decode.body[key], CHAT[key])  # type: ignore[index]

    async def test_prefill_leg_is_lowered_as_the_seed_does(self) -> None:
        await self.start()
        body = {
            "model": "m",
            "prompt": "hello",
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 64,
            "max_completion_tokens": 64,
            "min_tokens": 4,
            "min_completion_tokens": 2,
            "top_p": 0.5,
        }
        response = await self.post("/v1/completions", body)
        await response.content()

        (prefill,) = self.prefill.requests
        request_id = prefill.request_id
        assert request_id is not None
        self.assertEqual(
            prefill.body,
            {
                "model": "m",
                "prompt": "hello",
                "stream": False,
                "max_tokens": 1,
                "max_completion_tokens": 1,
                "top_p": 0.5,
                "kv_transfer_params": prefill_kv_transfer_params(request_id),
            },
        )
        self.assertEqual(prefill.body["kv_transfer_params"]["transfer_id"], f"xfer-{request_id}")  # type: ignore[index]

    async def test_decode_leg_is_the_client_body_plus_verbatim_params(self) -> None:
        await self.start()
        body = dict(CHAT, stream=True, stream_options={"include_usage": True}, max_tokens=5)
        response = await self.post("/v1/chat/completions", body)
        await response.content()

        (decode,) = self.decode.requests
        issued = self.ledger.redeemed[0]
        self.assertEqual(decode.body, dict(body, kv_transfer_params=issued))
        # Nested lists and keys vLLM may add later arrived as issued.
        self.assertEqual(issued["remote_block_ids"], [[0], [100]])
        self.assertIn("x_future_key", issued)
        self.assertEqual(self.ledger.issued, {})

    async def test_max_tokens_always_one_on_prefill_even_when_absent(self) -> None:
        await self.start()
        response = await self.post("/v1/completions", {"model": "m", "prompt": "hi"})
        await response.content()
        prefill_body = self.prefill.requests[0].body
        assert prefill_body is not None
        self.assertEqual(prefill_body["max_tokens"], 1)
        self.assertNotIn("max_completion_tokens", prefill_body)
        decode_body = self.decode.requests[0].body
        assert decode_body is not None
        self.assertNotIn("max_tokens", decode_body)

    async def test_query_string_reaches_both_legs(self) -> None:
        await self.start()
        response = await self.post("/v1/completions?debug=1", {"model": "m", "prompt": "hi"})
        self.assertEqual(response.code, 200)
        await response.content()
        self.assertEqual(self.prefill.requests[0].path, "/v1/completions")
        self.assertEqual(self.prefill.requests[0].query, b"debug=1")
        self.assertEqual(self.decode.requests[0].query, b"debug=1")


class StreamingTests(ProxyCase):
    async def test_stream_relayed_with_decode_status_and_content_type(self) -> None:
        await self.start(tokens=6)
        response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))

        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        self.assertIsNone(response.headers.getRawHeaders(b"content-length"))
        events = sse_events(await response.content())
        self.assertEqual(events[-1], "[DONE]")
        words = [e["choices"][0]["delta"].get("content", "") for e in events[:-1]]
        self.assertEqual(len([w for w in words if w]), 6)

    async def test_first_chunk_reaches_client_while_decode_holds_the_rest(self) -> None:
        await self.start(tokens=5)
        self.decode.hold_streams_after(2)
        held = self.decode.stream_held()
        response = await self.post(
            "/v1/completions", {"model": "m", "prompt": "hi", "stream": True}
        )
        collector = ChunkCollector()
        response.deliverBody(collector)

        await held
        await collector.received(b'"text": "Hello "')
        # The decode still holds the stream: the proxy passed on what it had.
        self.assertNotIn(b"[DONE]", collector.body)
        self.assertFalse(collector.done.called)

        self.decode.release()
        body = b"".join(await collector.done)
        self.assertEqual(sse_events(body)[-1], "[DONE]")
        self.assertEqual(len(sse_events(body)), 6)

    async def test_non_streaming_body_and_length_relayed_exactly(self) -> None:
        await self.start(tokens=4)
        prompt = {"model": "m", "prompt": "one two three four"}
        response = await self.post("/v1/completions", prompt)
        raw = await response.content()
        answer = json.loads(raw)
        self.assertEqual(answer["object"], "text_completion")
        self.assertEqual(answer["choices"][0]["text"], "Hello from the fake ")
        # Decode reports the cached tokens prefill put in kv_transfer_params.
        self.assertEqual(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 2)
        lengths = response.headers.getRawHeaders(b"content-length")
        if lengths is not None:
            self.assertEqual(lengths, [str(len(raw)).encode()])


class RotationTests(ProxyCase):
    async def test_round_robin_over_each_pool(self) -> None:
        await self.start(prefills=2, decodes=3)
        for _ in range(6):
            response = await self.post("/v1/completions", {"model": "m", "prompt": "hi"})
            await response.content()
        self.assertEqual([len(p.requests) for p in self.prefills], [3, 3])
        self.assertEqual([len(d.requests) for d in self.decodes], [2, 2, 2])

    async def test_concurrent_requests_spread_and_all_complete(self) -> None:
        await self.start(prefills=2, decodes=2)

        async def one() -> int:
            response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))
            await response.content()
            return int(response.code)

        codes = await gatherResults([self.ensure(one()) for _ in range(10)])
        self.assertEqual(codes, [200] * 10)
        self.assertEqual([len(p.requests) for p in self.prefills], [5, 5])
        self.assertEqual([len(d.requests) for d in self.decodes], [5, 5])
