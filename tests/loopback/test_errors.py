"""Every error a client can get, and that no backend is called when none should be."""

from __future__ import annotations

import json
from typing import cast

from twisted.internet.interfaces import IPushProducer
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from twisted.web.client import ResponseFailed
from zope.interface import provider

from nixl_twisted import __version__
from nixl_twisted.protocol.lowering import prompt_count
from nixl_twisted.testing import TransferLedger
from tests.support import CHAT, ChunkCollector, ProxyCase, closed_port_url, sse_events


class ClientErrorTests(ProxyCase):
    async def test_invalid_json_is_400_and_no_backend_called(self) -> None:
        await self.start()
        for raw in (b"{not json", b"", b'{"prompt": NaN}', b"\xff\xfe"):
            response, answer = await self.post_json("/v1/completions", raw)
            self.assertError(response, answer, 400, "invalid_json")
        self.assertEqual(self.prefill.requests + self.decode.requests, [])

    async def test_body_that_is_not_an_object_is_400(self) -> None:
        await self.start()
        for body in ([CHAT], "text", 3, None):
            response, answer = await self.post_json("/v1/chat/completions", body)
            self.assertError(response, answer, 400, "invalid_body")
            self.assertIn("JSON object", answer["error"]["message"])
        self.assertEqual(self.prefill.requests, [])

    async def test_a_batch_never_reaches_a_backend_as_one_request(self) -> None:
        await self.start()
        for prompt in (["a", "b"], [[1, 2], [3, 4]]):
            response, _ = await self.post_json("/v1/completions", {"model": "m", "prompt": prompt})
            self.assertEqual(response.code, 200)
        # Each backend request carries one prompt: four parts, never a list of two.
        for fake in (self.prefill, self.decode):
            self.assertEqual(len(fake.requests), 4)
            for received in fake.requests:
                assert received.body is not None
                self.assertEqual(prompt_count(received.body["prompt"]), 1)

    async def test_single_prompt_lists_are_served(self) -> None:
        await self.start()
        for prompt in (["just one"], [1, 2, 3], [[1, 2, 3]]):
            response = await self.post("/v1/completions", {"model": "m", "prompt": prompt})
            await response.content()
            self.assertEqual(response.code, 200)
        self.assertEqual(len(self.decode.requests), 3)

    async def test_unknown_path_and_wrong_method_are_json_4xx(self) -> None:
        await self.start()
        response = await self.http.get(self.proxy.url + "/v1/embeddings")
        self.assertError(response, json.loads(await response.content()), 404, "not_found")
        response = await self.http.get(self.proxy.url + "/v1/completions")
        self.assertError(response, json.loads(await response.content()), 405, "method_not_allowed")
        self.assertEqual(response.headers.getRawHeaders(b"allow"), [b"POST"])


class PrefillErrorTests(ProxyCase):
    async def test_prefill_4xx_is_relayed_with_its_status_and_body(self) -> None:
        await self.start()
        self.prefill.refuse_next(400, "This model's maximum context length is 8 tokens")
        response, answer = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 400)
        self.assertEqual(
            answer["error"]["message"], "This model's maximum context length is 8 tokens"
        )
        self.assertEqual(answer["error"]["type"], "BadRequestError")
        self.assertEqual(self.decode.requests, [])

    async def test_prefill_5xx_is_502_naming_leg_and_instance(self) -> None:
        await self.start()
        self.prefill.crash_next(500)
        response, answer = await self.post_json("/v1/chat/completions", CHAT)
        self.assertError(response, answer, 502, "prefill_failed")
        self.assertIn("prefill instance " + self.prefill.url, answer["error"]["message"])
        self.assertIn("500", answer["error"]["message"])
        self.assertEqual(self.decode.requests, [])

    async def test_unreachable_prefill_is_502(self) -> None:
        await self.start()
        dead = await closed_port_url()
        self.proxy = self.start_proxy([dead], [self.decode.url])
        response, answer = await self.post_json("/v1/chat/completions", CHAT)
        self.assertError(response, answer, 502, "prefill_unreachable")
        self.assertIn(f"prefill instance {dead} could not be reached", answer["error"]["message"])
        self.assertEqual(self.decode.requests, [])

    async def test_missing_kv_transfer_params_is_502_as_the_seed_says(self) -> None:
        await self.start()
        self.prefill.omit_kv_transfer_params_next()
        response, answer = await self.post_json("/v1/completions", {"model": "m", "prompt": "x"})
        self.assertError(response, answer, 502, "missing_kv_transfer_params")
        self.assertIn(
            "prefill response did not include kv_transfer_params", answer["error"]["message"]
        )
        self.assertIn(self.prefill.url, answer["error"]["message"])
        self.assertEqual(self.decode.requests, [])


class DecodeErrorTests(ProxyCase):
    async def test_unreachable_decode_is_502(self) -> None:
        await self.start()
        dead = await closed_port_url()
        self.proxy = self.start_proxy([self.prefill.url], [dead])
        response, answer = await self.post_json("/v1/chat/completions", dict(CHAT, stream=True))
        self.assertError(response, answer, 502, "decode_unreachable")
        self.assertIn(f"decode instance {dead}", answer["error"]["message"])
        self.assertEqual(len(self.prefill.requests), 1)

    async def test_decode_error_answers_are_relayed_as_they_are(self) -> None:
        await self.start()
        for status in (400, 500):
            self.decode.crash_next(status, f"decode says {status}")
            response, answer = await self.post_json("/v1/chat/completions", CHAT)
            self.assertEqual(response.code, status)
            self.assertEqual(answer["error"]["message"], f"decode says {status}")
            self.assertEqual(answer["error"]["code"], status)

    async def test_kv_load_failure_on_decode_reaches_client(self) -> None:
        # A decode that cannot load the KV blocks (here: it never heard of
        # them) answers 500, and the client gets that answer.
        await self.start()
        self.decode.ledger = TransferLedger()
        response, answer = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 500)
        self.assertIn("KV load failed", answer["error"]["message"])


class BrokenBodyTests(ProxyCase):
    async def test_a_stream_cut_off_ends_with_an_error_event_not_a_clean_end(self) -> None:
        await self.start(tokens=5)
        self.decode.break_next(after_events=2)
        response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))
        self.assertEqual(response.code, 200)
        collector = ChunkCollector()
        response.deliverBody(collector)
        with self.assertRaises(ResponseFailed):
            await collector.done
        events = sse_events(collector.body)
        self.assertEqual(len(events), 3)
        self.assertEqual(events[-1]["error"]["code"], "decode_stream_broken")
        # Said for people, no Python reprs (the detail is in the proxy's log).
        self.assertEqual(events[-1]["error"]["message"], "decode closed the stream early")
        self.assertNotIn("[DONE]", events)

    async def test_every_answer_says_server_nixl_twisted(self) -> None:
        await self.start()
        relayed = await self.post("/v1/chat/completions", CHAT)
        await relayed.content()
        own = await self.http.get(self.proxy.url + "/healthcheck")
        await own.content()
        for response in (relayed, own):
            self.assertEqual(
                response.headers.getRawHeaders(b"server"), [f"nixl-twisted/{__version__}".encode()]
            )

    async def test_a_json_body_cut_off_is_never_finished_as_complete(self) -> None:
        await self.start()
        self.decode.break_next()
        response = await self.post("/v1/completions", {"model": "m", "prompt": "x"})
        self.assertEqual(response.code, 200)
        with self.assertRaises(ResponseFailed):
            await response.content()

    async def test_a_prefill_answer_cut_off_is_502(self) -> None:
        await self.start()
        self.prefill.break_next()
        response, answer = await self.post_json("/v1/completions", {"model": "m", "prompt": "x"})
        self.assertError(response, answer, 502, "prefill_invalid_response")
        self.assertEqual(self.decode.requests, [])

    async def test_the_proxy_serves_on_after_a_broken_backend(self) -> None:
        await self.start()
        self.decode.break_next()
        broken = await self.post("/v1/completions", {"model": "m", "prompt": "x"})
        with self.assertRaises(ResponseFailed):
            await broken.content()
        response, answer = await self.post_json("/v1/completions", {"model": "m", "prompt": "x"})
        self.assertEqual(response.code, 200)
        self.assertEqual(answer["object"], "text_completion")


class DisconnectTests(ProxyCase):
    async def test_client_leaving_mid_stream_closes_the_decode_connection(self) -> None:
        await self.start(tokens=5)
        collector = await self.held_stream()
        (decode_channel,) = self.decode.site.channels()
        decode_closed = self.decode.site.connection_lost(decode_channel)

        cast(IPushProducer, collector.transport).stopProducing()  # the client goes away
        with self.assertRaises(ResponseFailed):
            await collector.done
        await decode_closed
        self.decode.release()
        self.assertEqual(self.decode.disconnects, 1)


class BadBackendLogTests(ProxyCase):
    async def test_garbage_from_prefill_is_502_with_an_error_line_naming_the_request(self) -> None:
        events: list[dict[str, object]] = []

        @provider(ILogObserver)
        def observe(event: dict[str, object]) -> None:
            events.append(event)

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        await self.start()
        self.prefill.answer_next_with(200, b"<html>oops</html>", b"text/html")
        response, answer = await self.post_json("/v1/chat/completions", CHAT)
        self.assertError(response, answer, 502, "prefill_invalid_response")
        (request_id,) = response.headers.getRawHeaders(b"x-request-id")
        errors = [formatEvent(e) for e in events if e.get("log_level") == LogLevel.error]
        self.assertTrue(any(request_id.decode() in line for line in errors), errors)
        await self.serves_on()

    async def serves_on(self) -> None:
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 200)
