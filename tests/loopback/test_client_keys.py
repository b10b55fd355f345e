"""``--api-key`` and ``--api-keys-file``: the official clients with their keys, refusals first."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import anthropic
import openai
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.web.client import Agent, HTTPConnectionPool

from tests.support import CHAT, ProxyCase, sse_events

KEY, OTHER, BACKEND = "sk-proxy-client", "sk-team-b", "sk-backend"


class ClientKeyTests(ProxyCase):
    async def keyed(self, **settings: Any) -> None:
        await self.start(tokens=4, proxy={"backend_api_key": BACKEND, **settings})

    async def raw(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes = b"",
        announced: int = 1000,
        closes: bool = False,
    ) -> tuple[int, Any]:
        """One request over a socket of its own: its head, announcing ``announced`` bytes
        of body, then ``body``; the answer read by its ``Content-Length`` (not by a close:
        a 401 must not wait for a body never sent).

        ``closes``: then read on until the proxy closes, and nothing more may come. An
        error on the socket (a reset while sending) fails the test: no answer was heard.
        """
        host, port = self.proxy.url.removeprefix("http://").rsplit(":", 1)

        def exchange() -> tuple[bytes, bytes]:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
                sock.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {announced}\r\n{head}\r\n".encode()
                    + body
                )
                received = b""
                while b"\r\n\r\n" not in received or len(received) < answer_length(received):
                    chunk = sock.recv(65536)
                    self.assertTrue(chunk, f"closed before a whole answer: {received!r}")
                    received += chunk
                after = b""
                while closes and (chunk := sock.recv(65536)):
                    after += chunk
                return received, after

        def answer_length(received: bytes) -> int:
            head = received.split(b"\r\n\r\n", 1)[0]
            length = head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]
            return len(head) + 4 + int(length)

        answer, after = await deferToThread(exchange)
        self.assertEqual(after, b"")
        head, _, content = answer.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), json.loads(content)

    async def test_no_key_or_a_wrong_one_is_401_in_the_routes_shape_before_the_body(self) -> None:
        await self.keyed(api_key=[KEY])
        status, body = await self.raw("/v1/chat/completions", {})
        self.assertEqual((status, body["error"]["code"]), (401, "invalid_api_key"))
        status, body = await self.raw("/v1/chat/completions", {"Authorization": "Bearer nope"})
        self.assertEqual((status, body["error"]["type"]), (401, "authentication_error"))
        status, body = await self.raw("/v1/messages", {"x-api-key": "nope"})
        self.assertEqual(
            (status, body),
            (
                401,
                {
                    "type": "error",
                    "error": {
                        "type": "authentication_error",
                        "message": "a valid API key is required (Authorization: Bearer KEY)",
                    },
                },
            ),
        )
        # Waiting for 100 Continue, the client has sent no body: closed at once, no 100.
        status, body = await self.raw("/v1/completions", {"Expect": "100-continue"}, closes=True)
        self.assertEqual((status, body["error"]["code"]), (401, "invalid_api_key"))
        self.assertEqual(self.prefill.requests, [])
        response = await self.http.get(self.proxy.url + "/healthcheck")  # (asks for no key)
        self.assertEqual(response.code, 200)
        await response.content()

    async def test_a_large_body_without_a_key_gets_the_whole_401_then_a_close(self) -> None:
        """The body is read and dropped after the 401: a client still sending it hears the
        answer, not a reset connection (which is what closing at once gave it)."""
        await self.keyed(api_key=[KEY])
        body = b'{"prompt": "' + b"x" * (4 * 1024 * 1024) + b'"}'
        status, answer = await self.raw("/v1/completions", {}, body, len(body), closes=True)
        self.assertEqual((status, answer["error"]["code"]), (401, "invalid_api_key"))
        self.assertEqual(self.prefill.requests, [])

    async def test_the_openai_client_with_its_key_and_vllm_gets_the_backend_key(self) -> None:
        await self.keyed(api_key=[KEY, OTHER])

        def call(key: str) -> str:
            client = openai.OpenAI(base_url=self.proxy.url + "/v1", api_key=key, max_retries=0)
            try:
                answer = client.chat.completions.create(
                    model="fake-model", messages=[{"role": "user", "content": "hi"}]
                )
                return str(answer.choices[0].message.content)
            finally:
                client.close()

        self.assertTrue(await deferToThread(call, KEY))
        with self.assertRaises(openai.AuthenticationError):
            await deferToThread(call, "sk-wrong")
        (prefill,) = self.prefill.requests
        (decode,) = self.decode.requests
        self.assertEqual((prefill.authorization, decode.authorization), (f"Bearer {BACKEND}",) * 2)

    async def test_the_anthropic_client_with_its_x_api_key(self) -> None:
        await self.keyed(api_key=[KEY])

        def call(key: str) -> str:
            client = anthropic.Anthropic(base_url=self.proxy.url, api_key=key, max_retries=0)
            try:
                answer = client.messages.create(
                    model="fake-model",
                    max_tokens=8,
                    messages=[{"role": "user", "content": "hi"}],
                )
                return answer.content[0].text  # type: ignore[union-attr]
            finally:
                client.close()

        self.assertTrue(await deferToThread(call, KEY))
        with self.assertRaises(anthropic.AuthenticationError):
            await deferToThread(call, "sk-wrong")
        self.assertEqual(self.decode.requests[0].authorization, f"Bearer {BACKEND}")
        self.assertIsNone(self.decode.requests[0].headers.getRawHeaders(b"x-api-key"))

    async def test_a_keys_file_is_read_again_when_it_changes(self) -> None:
        where = Path(tempfile.mkdtemp(prefix="nixlproxy-keys-"))
        self.addCleanup(shutil.rmtree, where)
        keys = where / "keys"
        keys.write_text(f"# the teams\n{KEY} team-a\n")
        await self.keyed(api_keys_file=str(keys))
        headers = {"Authorization": f"bearer {KEY}"}  # (the scheme in any case)
        response, _ = await self.post_json("/v1/chat/completions", CHAT, headers)
        self.assertEqual(response.code, 200)

        (where / "keys.new").write_text(f"{OTHER} team-b\n")
        (where / "keys.new").replace(keys)  # renamed into place, as docs/security.md says
        self.clock.advance(2)  # seen,
        self.clock.advance(2)  # and seen the same: applied
        response, _ = await self.post_json("/v1/chat/completions", CHAT, headers)
        self.assertEqual(response.code, 401)
        headers = {"Authorization": f"Bearer {OTHER}"}
        response, _ = await self.post_json("/v1/chat/completions", CHAT, headers)
        self.assertEqual(response.code, 200)


class TenantLimitTests(ProxyCase):
    async def teams(self, **settings: Any) -> None:
        where = Path(tempfile.mkdtemp(prefix="nixlproxy-keys-"))
        self.addCleanup(shutil.rmtree, where)
        (where / "keys").write_text(f"{KEY} team-a\n{OTHER} team-b\n")
        await self.start(tokens=4, proxy={"api_keys_file": str(where / "keys"), **settings})

    async def refused_or_served(
        self, headers: dict[str, str], path: str = "/v1/chat/completions", body: Any = CHAT
    ) -> tuple[Any, Any]:
        """A request on a connection of its own (a held stream keeps one busy; the proxy's
        clock, moved by a test, times idle ones out)."""
        sent: dict[bytes | str, bytes | str] = {name: value for name, value in headers.items()}
        response = await self.fresh().post(self.proxy.url + path, json=body, headers=sent)
        return response, json.loads(await response.content())

    def fresh(self) -> HTTPClient:
        return HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))

    async def test_a_tenant_at_its_in_flight_limit_gets_429_while_another_is_served(self) -> None:
        await self.teams(tenant_max_in_flight=1)
        team_a = {"Authorization": f"Bearer {KEY}"}
        self.decode.hold_streams_after(1)
        held = self.decode.stream_held()
        stream = await self.post("/v1/chat/completions", dict(CHAT, stream=True), team_a)
        await held
        response, answer = await self.refused_or_served(team_a)
        self.assertEqual((response.code, answer["error"]["code"]), (429, "rate_limit_exceeded"))
        self.assertEqual(response.headers.getRawHeaders(b"retry-after"), [b"1"])
        self.assertIn("team-a", answer["error"]["message"])
        # (The fake holds every generation now: another tenant's request that is not one.)
        tokenize = {"model": "fake-model", "prompt": "hello"}
        response, _ = await self.refused_or_served(
            {"Authorization": f"Bearer {OTHER}"}, "/tokenize", tokenize
        )
        self.assertEqual(response.code, 200)
        response, _ = await self.refused_or_served(team_a, "/tokenize", tokenize)
        self.assertEqual(response.code, 429)
        self.decode.release()
        await stream.content()
        response, _ = await self.refused_or_served(team_a)
        self.assertEqual(response.code, 200)  # its stream ended: room again

    async def test_tokens_per_minute_are_counted_from_the_usage_of_a_stream(self) -> None:
        await self.teams(tenant_tokens_per_minute=8)
        team_a = {"Authorization": f"Bearer {KEY}"}
        body = dict(CHAT, stream=True, stream_options={"include_usage": True})
        response = await self.post("/v1/chat/completions", body, team_a)
        self.assertEqual(response.code, 200)
        await response.content()  # usage: the fake's prompt tokens plus its 4 generated
        response, answer = await self.post_json("/v1/chat/completions", CHAT, team_a)
        self.assertEqual((response.code, answer["error"]["code"]), (429, "rate_limit_exceeded"))
        self.assertIn("8 tokens per minute", answer["error"]["message"])
        self.clock.advance(60)
        response, _ = await self.refused_or_served(team_a)
        self.assertEqual(response.code, 200)

    async def test_a_refused_request_is_not_charged_its_estimate(self) -> None:
        await self.teams(tenant_tokens_per_minute=8, max_batch_prompts=2)
        team_a = {"Authorization": f"Bearer {KEY}"}
        too_many = {"model": "fake-model", "prompt": ["a", "b", "c"], "max_tokens": 1000}
        response, _ = await self.refused_or_served(team_a, "/v1/completions", too_many)
        self.assertEqual(response.code, 400)
        response, _ = await self.refused_or_served(team_a)
        self.assertEqual(response.code, 200)  # (charged 1,000 tokens before: a 429 for a minute)

    async def test_a_stream_that_did_not_ask_for_usage_is_charged_it_and_never_sees_it(
        self,
    ) -> None:
        # team-b has no tokens limit: its stream is what the client sees without one.
        await self.teams(tenant_tokens_per_minute=8, tenants={"team-b": {"tokens-per-minute": 0}})
        streamed = dict(CHAT, stream=True)
        seen = []
        for key in (OTHER, KEY):
            response = await self.post(
                "/v1/chat/completions", streamed, {"Authorization": f"Bearer {key}"}
            )
            self.assertEqual(response.code, 200)
            seen.append(sse_events(await response.content()))
        unlimited, counted = seen
        self.assertEqual(
            [len(event["choices"]) if isinstance(event, dict) else event for event in counted],
            [len(event["choices"]) if isinstance(event, dict) else event for event in unlimited],
        )
        self.assertFalse([event for event in counted if "usage" in event])
        asked = [(r.body or {}).get("stream_options") for r in self.decode.requests_for("decode")]
        self.assertEqual(asked, [None, {"include_usage": True}])  # (team-a's, for the proxy)
        # Charged what vLLM said (its prompt and 4 tokens), not a prompt alone.
        response, answer = await self.post_json(
            "/v1/chat/completions", CHAT, {"Authorization": f"Bearer {KEY}"}
        )
        self.assertEqual((response.code, answer["error"]["code"]), (429, "rate_limit_exceeded"))

    async def test_stored_responses_count_as_requests_and_generate_no_tokens(self) -> None:
        await self.teams(tenant_requests_per_minute=3, tenant_tokens_per_minute=1)
        team_a = {"Authorization": f"Bearer {KEY}"}
        response, _ = await self.post_json("/v1/chat/completions", CHAT, team_a)
        self.assertEqual(response.code, 200)  # (nothing in its window: let through)
        tokenize = {"model": "fake-model", "prompt": "hello"}
        response, _ = await self.refused_or_served(team_a, "/tokenize", tokenize)
        self.assertEqual(response.code, 200)  # over its tokens, but it generates none
        keyed: dict[bytes | str, bytes | str] = {"Authorization": f"Bearer {KEY}"}
        fetched = await self.fresh().get(
            self.proxy.url + "/v1/responses/resp_unknown",
            headers=keyed,
        )
        await fetched.content()
        self.assertNotEqual(fetched.code, 429)
        response, answer = await self.refused_or_served(team_a, "/tokenize", tokenize)
        self.assertEqual((response.code, answer["error"]["code"]), (429, "rate_limit_exceeded"))
        self.assertIn("3 requests per minute", answer["error"]["message"])

    async def test_the_access_event_names_the_tenant_whether_or_not_it_has_limits(self) -> None:
        await self.start(tokens=4, proxy={"api_key": [KEY], "tenant_header": "x-team"})
        events = self.access_events()
        headers = {"Authorization": f"Bearer {KEY}", "x-team": "ignored: the key wins"}
        response, _ = await self.post_json("/v1/chat/completions", CHAT, headers)
        self.assertEqual(response.code, 200)
        fingerprint = "key-" + hashlib.sha256(KEY.encode()).hexdigest()[:12]
        self.assertEqual([event.get("tenant") for event in events], [fingerprint])

    async def test_a_tenants_priority_reaches_both_legs_and_a_client_cannot_better_it(
        self,
    ) -> None:
        await self.teams(tenants={"team-a": {"priority": 4}})
        team_a = {"Authorization": f"Bearer {KEY}"}
        for asked in (-50, 9):
            response, _ = await self.post_json(
                "/v1/chat/completions", dict(CHAT, priority=asked), team_a
            )
            self.assertEqual(response.code, 200)
        response, _ = await self.post_json(
            "/v1/chat/completions", CHAT, {"Authorization": f"Bearer {OTHER}"}
        )
        self.assertEqual(response.code, 200)
        for role, fake in (("prefill", self.prefill), ("decode", self.decode)):
            sent = [(r.body or {}).get("priority") for r in fake.requests_for(role)]
            self.assertEqual(sent, [4, 9, None], role)  # (team-b has none: the client's)

    async def test_a_streamed_batch_is_charged_its_parts_usage_and_shows_none(self) -> None:
        await self.teams(tenant_tokens_per_minute=12)
        team_a = {"Authorization": f"Bearer {KEY}"}
        batch = {"model": "fake-model", "prompt": ["a", "b"], "stream": True}
        response = await self.post("/v1/completions", batch, team_a)
        self.assertEqual(response.code, 200)
        events = sse_events(await response.content())
        self.assertEqual(events[-1], "[DONE]")
        self.assertFalse([event for event in events if "usage" in event])
        asked = [(r.body or {}).get("stream_options") for r in self.decode.requests_for("decode")]
        self.assertEqual(asked, [{"include_usage": True}] * 2)
        # Both parts' prompts and 4 tokens each: past 12.
        response, answer = await self.refused_or_served(team_a)
        self.assertEqual((response.code, answer["error"]["code"]), (429, "rate_limit_exceeded"))
