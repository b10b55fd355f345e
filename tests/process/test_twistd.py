"""A real ``twistd nixlproxy`` process between fake vLLM instances."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.testing.process import TwistdFailed
from tests.process.support import TwistdCase
from tests.support import CHAT, ChunkCollector, sse_events


class TwistdTests(TwistdCase):
    async def test_serves_a_stream_and_exits_0_on_sigterm(self) -> None:
        await self.start(tokens=4)
        process = self.spawn(
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
        )
        address = await process.listening
        url = f"http://{address}"

        response = await self.http.get(url + "/healthcheck")
        self.assertEqual(response.code, 200)
        await response.content()
        response = await self.http.post(
            url + "/v1/chat/completions",
            json=dict(CHAT, stream=True),
            unbuffered=True,
        )
        self.assertEqual(response.code, 200)
        events = sse_events(await response.content())
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(len(self.ledger.redeemed), 1)

        await self.terminate(process)

    async def test_sigterm_lets_a_stream_in_flight_finish_then_exits_0(self) -> None:
        await self.start(tokens=3)
        self.decode.hold_streams_after(1)
        held = self.decode.stream_held()
        process = self.spawn(
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
        )
        url = f"http://{await process.listening}"
        response = await self.http.post(
            url + "/v1/chat/completions", json=dict(CHAT, stream=True), unbuffered=True
        )
        collector = ChunkCollector()
        response.deliverBody(collector)
        await held

        os.kill(process.transport.pid, signal.SIGTERM)  # type: ignore[union-attr]
        await process.said(b"draining 1 request in flight")
        self.assertFalse(process.ended.called)
        self.decode.release()
        events = sse_events(b"".join(await collector.done))
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(await process.ended, 0, process.output.decode())

    async def test_shutdown_delay_serves_while_not_ready_then_exits_0(self) -> None:
        await self.start()
        process = self.spawn(
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--shutdown-delay",
            "1",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
        )
        url = f"http://{await process.listening}"
        os.kill(process.transport.pid, signal.SIGTERM)  # type: ignore[union-attr]
        await process.said(b"not ready now; still serving for 1")
        health = await self.http.get(url + "/healthcheck")
        self.assertEqual(health.code, 503)
        await health.content()
        response = await self.http.post(url + "/v1/chat/completions", json=CHAT)
        self.assertEqual(response.code, 200)  # still served
        await response.content()
        self.assertEqual(await process.ended, 0, process.output.decode())

    async def test_json_log_lines(self) -> None:
        await self.start()
        process = self.spawn(
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--log-format",
            "json",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
        )
        url = f"http://{await process.listening}"
        response = await self.http.post(url + "/v1/chat/completions", json=CHAT)
        await response.content()
        (request_id,) = response.headers.getRawHeaders(b"x-request-id")
        await process.said(request_id)
        await self.terminate(process)
        lines = [line for line in process.output.splitlines() if line.strip()]
        events = [json.loads(line) for line in lines]
        for event in events:  # flat: the documented keys, rendered, no Twisted internals
            self.assertLessEqual({"time", "level", "logger", "message"}, set(event))
            self.assertIsInstance(event["level"], str)
            self.assertFalse([key for key in event if key.startswith("log_")])
        (access,) = [e for e in events if e["logger"] == "nixlproxy.access"]
        self.assertEqual(access["request_id"], request_id.decode())
        self.assertEqual(access["status"], 200)
        self.assertEqual(access["decode"], self.decode.url)
        self.assertTrue(any(e["message"].startswith("nixlproxy listening on") for e in events))
        # Both legs, the model and the usage: about 500 bytes (configuration.md).
        self.assertLess(max(len(line) for line in lines if b"nixlproxy.access" in line), 560)

    async def test_log_level_warn_keeps_warnings_and_the_lifecycle_lines(self) -> None:
        await self.start()
        process = self.spawn(
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--log-level",
            "warn",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            "--decode",
            "http://127.0.0.1:1",
            "--health-interval",
            "0.2",
        )
        address = await process.listening  # a lifecycle line: shown at warn
        await process.said(b"marked down")
        response = await self.http.post(f"http://{address}/v1/chat/completions", json=CHAT)
        self.assertEqual(response.code, 200)
        await response.content()
        os.kill(process.transport.pid, signal.SIGTERM)  # type: ignore[union-attr]
        self.assertEqual(await process.ended, 0, process.output.decode())
        output = process.output.decode()
        self.assertIn("SIGTERM: draining", output)  # a lifecycle line too
        self.assertIn("[nixl_twisted.backends.pools#warn]", output)
        self.assertIn(f"prefill {self.prefill.url} (round-robin)", output)  # the summary
        self.assertIn("max-in-flight 1024, max-connections 4096", output)
        self.assertNotIn("nixlproxy.access", output)  # an info line

    async def test_json_logs_through_twistds_own_logger_option(self) -> None:
        await self.start()
        process = self.spawn(
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            twistd_args=["--logger=nixl_twisted.logs.json_lines"],
        )
        await process.listening
        await self.terminate(process)
        events = [json.loads(line) for line in process.output.splitlines() if line.strip()]
        self.assertTrue(any(e.get("logger") == "nixlproxy.lifecycle" for e in events))

    async def test_sighup_reloads_pools_under_load_with_no_failed_request(self) -> None:
        await self.start(decodes=2)
        old, new = self.decodes
        config = self.config_file(old.url)
        process = self.spawn("--listen", "tcp:0:interface=127.0.0.1", "--config", config)
        url = f"http://{await process.listening}"

        async def load(requests: int = 5) -> list[int]:
            codes = []
            for _ in range(requests):
                response = await self.http.post(url + "/v1/chat/completions", json=CHAT)
                await response.content()
                codes.append(response.code)
            return codes

        def batch() -> Deferred[list[list[int]]]:
            return gatherResults([self.ensure(load()) for _ in range(4)])

        first = await batch()
        self.config_file(new.url, config, "max-in-flight = 77\nworkers = 2\n")
        during = batch()
        os.kill(process.transport.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await process.said(b"SIGHUP: reloaded")
        await process.said(b"kept as they were: workers")
        self.assertIn(b"changed decode, max-in-flight", process.output)
        second = await during
        old_count = len(old.requests)
        third = await batch()

        self.assertEqual({c for codes in first + second + third for c in codes}, {200})
        self.assertEqual(len(old.requests), old_count)  # nothing new after the reload
        self.assertGreaterEqual(len(new.requests), 20)
        self.assertEqual(len(old.requests) + len(new.requests), 60)
        await self.terminate(process)

    async def test_sighup_without_a_config_file_reads_the_keys_file_again(self) -> None:
        """At once, as the operator who sends it expects: a key taken out is refused from then."""
        await self.start()
        keys = self.keys_file("sk-old team-a\n")
        process = self.spawn_keyed(keys)
        await self.revoke_by_sighup(process, f"http://{await process.listening}", keys)
        self.assertNotIn(b"nothing reloaded", process.output)
        await self.terminate(process)

    async def test_workers_share_the_port_are_restarted_and_drain_together(self) -> None:
        await self.start()
        process, address = await self.spawn_workers(
            "--prefill", self.prefill.url, "--decode", self.decode.url
        )
        url = f"http://{address}"
        once = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))

        async def pids(count: int = 40) -> set[int]:
            seen = set()
            for _ in range(count):  # each on a new connection
                response = await once.get(url + "/healthcheck")
                seen.add(json.loads(await response.content())["pid"])
            return seen

        first = await pids()
        self.assertEqual(len(first), 2, process.output.decode())
        response = await once.post(url + "/v1/chat/completions", json=CHAT)
        self.assertEqual(response.code, 200)
        await response.content()

        os.kill(min(first), signal.SIGKILL)
        await process.said(b"restarting it")
        await process.said(b"nixlproxy listening on", times=3)
        second = await pids()
        self.assertEqual(len(second), 2)
        self.assertNotIn(min(first), second)
        await self.terminate(process)
        for pid in second:
            with self.assertRaises(ProcessLookupError):
                os.kill(pid, 0)

    async def test_sighup_to_a_workers_parent_reloads_every_worker_and_the_parent_lives(
        self,
    ) -> None:
        await self.start(decodes=2)
        old, new = self.decodes
        config = self.config_file(old.url)
        process, address = await self.spawn_workers("--config", config)
        url = f"http://{address}"
        once = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))

        async def load(requests: int) -> tuple[list[int], set[int]]:
            codes, pids = [], set()
            for _ in range(requests):  # each on a new connection: both workers serve
                response = await once.post(url + "/v1/chat/completions", json=CHAT)
                await response.content()
                codes.append(response.code)
                health = await once.get(url + "/healthcheck")
                pids.add(json.loads(await health.content())["pid"])
            return codes, pids

        before, _ = await load(10)
        self.config_file(new.url, config)
        during = self.ensure(load(10))
        os.kill(process.transport.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await process.said(b"sent to 2 workers")
        await process.said(b"configuration reloaded from the supervisor", times=2)  # each, once
        while_reloading, _ = await during
        old_count = len(old.requests)
        after, pids = await load(40)

        self.assertFalse(process.ended.called, process.output.decode())
        os.kill(process.transport.pid, 0)  # type: ignore[union-attr]  # the parent lives
        self.assertEqual(len(pids), 2)  # both workers answered after the reload
        self.assertEqual(set(before + while_reloading + after), {200})
        self.assertEqual(len(old.requests), old_count)  # nothing new to the old pool
        self.assertGreaterEqual(len(new.requests), 40)
        await self.terminate(process)

    async def test_workers_stop_by_themselves_when_their_supervisor_is_killed(self) -> None:
        await self.start()
        process, address = await self.spawn_workers(
            "--prefill", self.prefill.url, "--decode", self.decode.url
        )
        os.kill(process.transport.pid, signal.SIGKILL)  # type: ignore[union-attr]
        # The workers share the parent's output: it closes only once both exited.
        await process.ended
        self.assertEqual(process.output.count(b"the supervisor is gone"), 2, process.output)
        self.assertEqual(process.output.count(b"Server Shut Down."), 2)
        with socket.socket() as probe:  # nobody serves the shared port any more
            self.assertNotEqual(probe.connect_ex(("127.0.0.1", int(address.rsplit(":", 1)[1]))), 0)

    async def test_serves_on_a_unix_socket(self) -> None:
        await self.start()
        path = os.path.join(tempfile.mkdtemp(), "nixlproxy.sock")
        process = self.spawn(
            "--listen", f"unix:{path}", "--prefill", self.prefill.url, "--decode", self.decode.url
        )
        self.assertEqual(await process.listening, path)
        from twisted.internet.endpoints import UNIXClientEndpoint
        from twisted.web.client import Agent

        class UNIXEndpoints:
            def endpointForURI(self, uri: Any) -> UNIXClientEndpoint:
                return UNIXClientEndpoint(reactor, path)

        agent = Agent.usingEndpointFactory(reactor, UNIXEndpoints())
        response = await agent.request(b"GET", b"http://proxy/healthcheck")
        import treq

        self.assertIn(b'"ready": true', await treq.content(response))
        await self.terminate(process)

    async def test_a_port_in_use_is_a_clear_failure(self) -> None:
        await self.start()
        taken = self.proxy.url.rsplit(":", 1)[1]
        process = self.spawn(
            "--listen",
            f"tcp:{taken}:interface=127.0.0.1",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
        )
        with self.assertRaises(TwistdFailed):
            await process.listening
        code = await process.ended
        self.assertNotEqual(code, 0, process.output.decode())
        self.assertIn(b"address already in use", process.output)
