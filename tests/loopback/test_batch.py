"""Batched /v1/completions: one prefill/decode pair per prompt, merged as vLLM would answer."""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.interfaces import IPushProducer
from twisted.web.client import ResponseFailed

from tests.support import ChunkCollector, ProxyCase, sse_events

PROMPTS = ["first prompt", "second prompt", "third prompt"]


def batch(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": PROMPTS, "max_tokens": 3, **extra}


class BatchTests(ProxyCase):
    async def test_each_prompt_is_its_own_pair_and_the_answer_is_merged(self) -> None:
        await self.start(prefills=2, decodes=2, tokens=3)
        response, answer = await self.post_json("/v1/completions", batch())
        self.assertEqual(response.code, 200)
        self.assertEqual([c["index"] for c in answer["choices"]], [0, 1, 2])
        self.assertEqual(answer["usage"]["completion_tokens"], 9)
        prefills = [r for p in self.prefills for r in p.requests_for("prefill")]
        decodes = [r for d in self.decodes for r in d.requests_for("decode")]
        self.assertEqual(sorted(r.body["prompt"] for r in prefills), sorted(PROMPTS))  # type: ignore[index]
        self.assertEqual(len(decodes), 3)
        self.assertEqual(len({r.request_id for r in prefills}), 3)  # its own id each
        self.assertEqual(len(response.headers.getRawHeaders(b"x-request-id")), 1)
        self.assertEqual(len(self.ledger.redeemed), 3)

    async def test_choice_indices_follow_prompt_index_times_n(self) -> None:
        await self.start(tokens=2)
        response, answer = await self.post_json("/v1/completions", batch(n=2))
        self.assertEqual(response.code, 200)
        self.assertEqual([c["index"] for c in answer["choices"]], [0, 2, 4])

    async def test_a_streamed_batch_is_multiplexed_with_one_usage_and_one_done(self) -> None:
        await self.start(tokens=3)
        body = batch(stream=True, stream_options={"include_usage": True})
        response = await self.post("/v1/completions", body)
        self.assertEqual(response.code, 200)
        events = sse_events(await response.content())
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(events.count("[DONE]"), 1)
        chunks = [e for e in events[:-1] if e["choices"]]
        self.assertEqual({c["choices"][0]["index"] for c in chunks}, {0, 1, 2})
        (usage,) = [e for e in events[:-1] if not e["choices"]]
        self.assertEqual(usage["usage"]["completion_tokens"], 9)

    async def test_a_part_failing_first_fails_the_request_and_stops_the_others(self) -> None:
        await self.start(tokens=3)
        self.prefill.crash_next(500, "engine died")
        response, answer = await self.post_json("/v1/completions", batch())
        self.assertEqual(response.code, 502)
        self.assertEqual(answer["error"]["code"], "prefill_failed")
        self.assertEqual(self.proxy.app.in_flight, 0)

    async def test_a_part_breaking_mid_stream_is_never_passed_off_as_complete(self) -> None:
        await self.start(tokens=5)
        self.decode.break_next(after_events=2)
        response = await self.post("/v1/completions", batch(stream=True))
        collector = ChunkCollector()
        response.deliverBody(collector)
        with self.assertRaises(ResponseFailed):
            await collector.done
        events = sse_events(collector.body)
        self.assertNotIn("[DONE]", events)
        self.assertEqual(events[-1]["error"]["code"], "batch_part_failed")

    async def test_more_prompts_than_the_limit_is_a_400_before_any_backend(self) -> None:
        await self.start(proxy=dict(max_batch_prompts=2))
        response, answer = await self.post_json("/v1/completions", batch())
        self.assertError(response, answer, 400, "too_many_prompts")
        self.assertEqual(self.prefill.requests, [])

    async def test_a_client_leaving_cancels_every_part(self) -> None:
        await self.start(tokens=5)
        collector = await self.held_stream(path="/v1/completions", body=batch(stream=True))
        channels = list(self.decode.site.channels())
        closed = [self.decode.site.connection_lost(c) for c in channels]
        cast(IPushProducer, collector.transport).stopProducing()
        with self.assertRaises(ResponseFailed):
            await collector.done
        for lost in closed:  # vLLM sees each part's connection close, and frees its blocks
            await lost
        self.assertGreaterEqual(len(channels), 1)
        self.assertEqual(self.proxy.app.in_flight, 0)
