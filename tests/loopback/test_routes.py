"""Request ids, headers, authorization, the seed's other routes, and connection reuse."""

from __future__ import annotations

import json
from io import BytesIO

import treq
from twisted.internet import reactor
from twisted.internet.defer import gatherResults
from twisted.internet.interfaces import ITCPTransport
from twisted.web.client import FileBodyProducer
from twisted.web.http_headers import Headers

from tests.support import CHAT, ChunkCollector, ProxyCase


class RequestIdTests(ProxyCase):
    async def test_one_fresh_id_on_both_legs_in_transfer_id_and_to_the_client(self) -> None:
        await self.start()
        # vLLM can echo an id of its own; the client still gets the proxy's.
        self.decode.extra_headers["X-Request-Id"] = "decode-echo"
        seen = set()
        for _ in range(3):
            response = await self.post(
                "/v1/chat/completions", CHAT, headers={"X-Request-Id": "client-chosen"}
            )
            await response.content()
            (echoed,) = response.headers.getRawHeaders(b"x-request-id")
            seen.add(echoed.decode())
        self.assertEqual(len(seen), 3)
        self.assertFalse({"client-chosen", "decode-echo"} & seen)
        for prefill, decode in zip(self.prefill.requests, self.decode.requests, strict=True):
            self.assertIn(prefill.request_id, seen)
            self.assertEqual(prefill.request_id, decode.request_id)
            self.assertEqual(
                prefill.body["kv_transfer_params"]["transfer_id"],  # type: ignore[index]
                f"xfer-{prefill.request_id}",
            )

    async def test_refusals_carry_a_request_id_too(self) -> None:
        await self.start()
        self.prefill.extra_headers["X-Request-Id"] = "prefill-echo"
        self.prefill.refuse_next(400)
        refused = await self.post("/v1/chat/completions", CHAT)
        await refused.content()
        invalid = await self.post("/v1/chat/completions", b"[]")
        await invalid.content()
        (refused_id,) = refused.headers.getRawHeaders(b"x-request-id")
        self.assertEqual(refused_id.decode(), self.prefill.requests[0].request_id)
        self.assertEqual(len(invalid.headers.getRawHeaders(b"x-request-id")), 1)


class AuthorizationTests(ProxyCase):
    async def test_client_authorization_reaches_both_legs(self) -> None:
        await self.start(proxy=dict(backend_api_key="operator-key"))
        response = await self.post(
            "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer client-key"}
        )
        await response.content()
        self.assertEqual(self.prefill.requests[0].authorization, "Bearer client-key")
        self.assertEqual(self.decode.requests[0].authorization, "Bearer client-key")

    async def test_operator_key_used_when_client_sends_none(self) -> None:
        await self.start(proxy=dict(backend_api_key="operator-key"))
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        models = await self.http.get(self.proxy.url + "/v1/models")
        await models.content()
        for request in self.prefill.requests + self.decode.requests:
            self.assertEqual(request.authorization, "Bearer operator-key")

    async def test_no_authorization_without_client_or_operator_key(self) -> None:
        await self.start()
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        self.assertIsNone(self.prefill.requests[0].authorization)
        self.assertIsNone(self.decode.requests[0].authorization)


class HeaderTests(ProxyCase):
    async def test_end_to_end_headers_forwarded_hop_by_hop_not(self) -> None:
        await self.start()
        response = await self.post(
            "/v1/chat/completions",
            CHAT,
            headers={
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "only for this connection",
                "Keep-Alive": "timeout=5",
            },
        )
        await response.content()
        for request in (self.prefill.requests[0], self.decode.requests[0]):
            headers = request.headers
            self.assertEqual(
                headers.getRawHeaders(b"traceparent"),
                [b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"],
            )
            self.assertIsNone(headers.getRawHeaders(b"x-hop"))
            self.assertIsNone(headers.getRawHeaders(b"keep-alive"))
            self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/json"])

    async def test_decode_response_headers_relayed_without_hop_by_hop(self) -> None:
        await self.start()
        self.decode.extra_headers.update(
            {"X-Backend-Note": "from decode", "Keep-Alive": "timeout=5", "Upgrade": "h2c"}
        )
        # A bare Agent: treq's own decoder would add headers of its own.
        response = await self.agent.request(
            b"POST",
            (self.proxy.url + "/v1/completions").encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(b'{"model": "m", "prompt": "x"}')),
        )
        await treq.content(response)
        self.assertEqual(response.headers.getRawHeaders(b"x-backend-note"), [b"from decode"])
        self.assertIsNone(response.headers.getRawHeaders(b"keep-alive"))
        self.assertIsNone(response.headers.getRawHeaders(b"upgrade"))
        self.assertIsNone(response.headers.getRawHeaders(b"content-encoding"))
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])


class SeedRouteTests(ProxyCase):
    async def test_healthcheck_reports_configured_instances(self) -> None:
        await self.start(prefills=2, decodes=1)
        response = await self.http.get(self.proxy.url + "/healthcheck")
        self.assertEqual(response.code, 200)
        answer = json.loads(await response.content())
        # The seed's three keys, as the seed has them.
        self.assertEqual(
            {k: answer[k] for k in ("ready", "prefill_instances", "decode_instances")},
            {"ready": True, "prefill_instances": 2, "decode_instances": 1},
        )
        self.assertEqual(
            [i["url"] for i in answer["instances"]["prefill"]], [p.url for p in self.prefills]
        )
        self.assertFalse(answer["draining"])
        self.assertEqual(self.prefill.requests, [])

    async def test_models_relayed_from_the_next_decode_instance(self) -> None:
        await self.start(decodes=2)
        for _ in range(4):
            response = await self.http.get(self.proxy.url + "/v1/models")
            self.assertEqual(response.code, 200)
            answer = json.loads(await response.content())
            self.assertEqual(answer["data"][0]["id"], "fake-model")
        self.assertEqual([len(d.requests) for d in self.decodes], [2, 2])
        self.assertEqual(self.prefill.requests, [])


class ConnectionTests(ProxyCase):
    async def test_backend_connections_are_reused(self) -> None:
        await self.start()
        for _ in range(5):
            response = await self.post("/v1/chat/completions", CHAT)
            await response.content()
        self.assertEqual(len(self.prefill.requests), 5)
        self.assertEqual(self.prefill.site.connections_accepted, 1)
        self.assertEqual(self.decode.site.connections_accepted, 1)

    async def test_more_than_two_idle_connections_are_kept_per_instance(self) -> None:
        # Twisted's default pool keeps 2; a burst of 8 streams must not
        # leave 6 sockets to be opened again on the next burst.
        await self.start(tokens=2)

        async def burst() -> None:
            self.decode.hold_streams_after(1)
            held = self.decode.stream_held()
            collectors = []
            for _ in range(8):
                response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))
                collector = ChunkCollector()
                response.deliverBody(collector)
                collectors.append(collector)
            await held
            self.decode.release()
            await gatherResults([c.done for c in collectors])

        await burst()
        self.assertEqual(self.decode.site.connections_accepted, 8)
        await burst()
        self.assertEqual(self.decode.site.connections_accepted, 8)

    async def test_idle_backend_connections_are_retired_after_the_idle_timeout(self) -> None:
        await self.start(proxy=dict(backend_idle_timeout=0.2))
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        (channel,) = self.decode.site.channels()
        # The proxy closes the idle connection itself, long before vLLM would.
        await self.decode.site.connection_lost(channel)
        self.assertEqual(self.decode.site.channels(), [])

    async def test_backend_sockets_have_nagle_off(self) -> None:
        await self.start()
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        for fake in (self.prefill, self.decode):
            (channel,) = fake.site.channels()
            proxy_end = channel.transport.getPeer()  # type: ignore[union-attr]
            (socket,) = [
                reader
                for reader in reactor.getReaders()
                if ITCPTransport.providedBy(reader) and reader.getHost() == proxy_end
            ]
            self.assertTrue(socket.getTcpNoDelay())

    async def test_client_sockets_have_nagle_off(self) -> None:
        await self.start()
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        site = self.proxy.site
        (channel,) = site.channels()
        assert ITCPTransport.providedBy(channel.transport)
        self.assertTrue(channel.transport.getTcpNoDelay())


class OneLegRouteTests(ProxyCase):
    async def test_tokenize_and_detokenize_go_to_a_decode_instance_as_they_are(self) -> None:
        await self.start(decodes=2)
        body = {"model": "m", "prompt": "x" * 40, "kv_transfer_params": {"do_remote_decode": True}}
        response, answer = await self.post_json("/tokenize", body)
        self.assertEqual(response.code, 200)
        self.assertEqual(answer["count"], 10)
        response, answer = await self.post_json("/detokenize", {"model": "m", "tokens": [1, 2]})
        self.assertEqual((response.code, answer["prompt"]), (200, "t1 t2"))
        seen = [r for d in self.decodes for r in d.requests]
        self.assertEqual(sorted(r.path for r in seen), ["/detokenize", "/tokenize"])
        # The client's kv_transfer_params never reach a backend.
        self.assertTrue(all("kv_transfer_params" not in (r.body or {}) for r in seen))
        self.assertEqual(self.prefill.requests, [])

    async def test_a_tokenize_body_that_is_not_json_is_refused_before_any_backend(self) -> None:
        await self.start()
        response, answer = await self.post_json("/tokenize", b"{nope")
        self.assertError(response, answer, 400, "invalid_json")
        self.assertEqual(self.decode.requests, [])

    async def test_a_dead_decode_is_retried_for_tokenize_too(self) -> None:
        await self.start(decodes=2, proxy=dict(decode_retries=1))
        await self.decodes[0].stop()
        for _ in range(2):
            response, _ = await self.post_json("/tokenize", {"model": "m", "prompt": "hi"})
            self.assertEqual(response.code, 200)
        self.assertEqual(len(self.decodes[1].requests), 2)
