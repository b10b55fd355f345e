"""Instances that die and come back: passive marks, active checks, retries, 503s."""

from __future__ import annotations

import json

from twisted.internet import reactor
from twisted.internet.defer import gatherResults

from nixl_twisted.backends.health import BACKOFF_BASE
from nixl_twisted.testing import start_proxy
from tests.support import CHAT, ProxyCase


class InstanceDeathTests(ProxyCase):
    async def completion(self) -> int:
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        return int(response.code)

    async def test_a_dead_decode_is_retried_elsewhere_then_left_out(self) -> None:
        await self.start(decodes=2, proxy=dict(unhealthy_threshold=1))
        dead = self.decodes[1]
        await dead.stop()
        codes = [await self.completion() for _ in range(4)]
        self.assertEqual(codes, [200] * 4)
        # The one attempt on the dead instance was retried on the live one
        # with the same kv_transfer_params; after that it is out of rotation.
        self.assertEqual(len(self.decodes[0].requests), 4)
        self.assertEqual(len(self.ledger.redeemed), 4)
        (live, down) = self.proxy.service.backends.decode.instances
        self.assertTrue(live.healthy)
        self.assertFalse(down.healthy)

    async def test_an_instance_comes_back_when_its_health_checks_pass(self) -> None:
        await self.start(prefills=2, proxy=dict(unhealthy_threshold=1))
        dead = self.prefills[1]
        port = dead.url.rsplit(":", 1)[1]
        await dead.stop()
        for _ in range(3):
            self.assertEqual(await self.completion(), 200)
        backends = self.proxy.service.backends
        self.assertFalse(backends.prefill.instances[1].healthy)

        await dead.listen(f"tcp:{port}:interface=127.0.0.1")
        await backends.check_health()
        self.assertFalse(backends.prefill.instances[1].healthy)  # two in a row bring it back
        await backends.check_health()
        self.assertTrue(backends.prefill.instances[1].healthy)
        for _ in range(4):
            self.assertEqual(await self.completion(), 200)
        self.assertEqual(len(dead.requests), 2)

    async def test_the_first_round_runs_at_startup_then_on_the_interval(self) -> None:
        await self.start(proxy=dict(health_interval=5))
        fakes = (self.prefill, self.decode)
        await self.proxy.service.backends.first_round()
        self.assertEqual([f.health_checks for f in fakes], [1, 1])  # before any interval
        checked = gatherResults([f.next_health_check() for f in fakes])
        self.clock.advance(5)
        await checked
        self.assertEqual([f.health_checks for f in fakes], [2, 2])

    async def test_a_failing_health_check_takes_an_instance_out(self) -> None:
        await self.start(decodes=2, proxy=dict(unhealthy_threshold=1))
        self.decodes[1].health_status = 503
        backends = self.proxy.service.backends
        await backends.check_health()
        self.assertEqual([i.healthy for i in backends.decode.instances], [True, False])
        for _ in range(4):
            self.assertEqual(await self.completion(), 200)
        self.assertEqual(self.decodes[1].requests, [])

    async def test_when_every_decode_is_down_legs_still_go_to_it(self) -> None:
        await self.start(proxy=dict(unhealthy_threshold=1))
        self.decode.health_status = 503
        backends = self.proxy.service.backends
        await backends.check_health()
        self.assertFalse(backends.decode.instances[0].healthy)

        health = await self.http.get(self.proxy.url + "/healthcheck")
        self.assertEqual(health.code, 503)
        report = json.loads(await health.content())
        self.assertFalse(report["ready"])
        self.assertEqual((report["prefill_instances"], report["decode_instances"]), (1, 1))
        self.assertEqual(report["instances"]["decode"][0]["state"], "down")
        self.assertIn("health check failed", report["instances"]["decode"][0]["last_error"])

        # Panic: its /health says 503, but it may still serve; refusing all would be worse.
        self.assertEqual(await self.completion(), 200)
        self.assertEqual(len(self.decode.requests), 1)
        self.assertTrue(backends.decode.panicking)
        metrics = await (await self.http.get(self.proxy.url + "/metrics")).text()
        self.assertIn('nixlproxy_panic_legs_total{pool="decode"} 1.0', metrics)

    async def test_a_dead_pool_in_panic_answers_502_not_a_hang(self) -> None:
        await self.start(proxy=dict(unhealthy_threshold=1))
        await self.decode.stop()
        await self.proxy.service.backends.check_health()
        response, answer = await self.post_json("/v1/chat/completions", CHAT)
        self.assertError(response, answer, 502, "decode_unreachable")
        models = await self.http.get(self.proxy.url + "/v1/models")
        self.assertEqual(models.code, 502)
        await models.content()

    async def test_models_skips_an_unhealthy_decode(self) -> None:
        await self.start(decodes=2, proxy=dict(unhealthy_threshold=1))
        self.decodes[0].health_status = 500
        await self.proxy.service.backends.check_health()
        for _ in range(3):
            response = await self.http.get(self.proxy.url + "/v1/models")
            self.assertEqual(response.code, 200)
            await response.content()
        self.assertEqual(self.decodes[0].health_checks, 1)
        self.assertEqual(self.decodes[1].health_checks, 1)

    async def test_after_its_backoff_a_down_instance_gets_another_try(self) -> None:
        await self.start(decodes=2, proxy=dict(unhealthy_threshold=1))
        self.decodes[1].health_status = 503
        backends = self.proxy.service.backends
        await backends.check_health()
        self.decodes[1].health_status = 200
        self.clock.advance(BACKOFF_BASE)
        for _ in range(2):
            self.assertEqual(await self.completion(), 200)
        self.assertEqual(len(self.decodes[1].requests), 1)
        trial = backends.decode.instances[1]
        self.assertEqual((trial.healthy, trial.successes), (False, 1))  # one of the two


class RetryTests(ProxyCase):
    async def test_prefill_503_is_retried_on_the_next_instance(self) -> None:
        await self.start(prefills=2)
        self.prefills[0].crash_next(503, "engine restarting")
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 200)
        self.assertEqual([len(p.requests) for p in self.prefills], [1, 1])
        self.assertEqual(len(self.decode.requests), 1)

    async def test_prefill_retries_are_bounded(self) -> None:
        await self.start(prefills=3, proxy=dict(prefill_retries=1))
        for prefill in self.prefills:
            prefill.crash_next(502)
        response, answer = await self.post_json("/v1/chat/completions", CHAT)
        self.assertError(response, answer, 502, "prefill_failed")
        self.assertEqual([len(p.requests) for p in self.prefills], [1, 1, 0])
        self.assertEqual(self.decode.requests, [])

    async def test_prefill_4xx_and_plain_500_are_never_retried(self) -> None:
        await self.start(prefills=2)
        self.prefills[0].refuse_next(400)
        response = await self.post("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 400)
        await response.content()
        self.prefills[1].crash_next(500)
        response = await self.post("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 502)
        await response.content()
        self.assertEqual([len(p.requests) for p in self.prefills], [1, 1])
        self.assertEqual(self.decode.requests, [])

    async def test_decode_error_answers_are_not_retried(self) -> None:
        await self.start(decodes=2)
        self.decodes[0].crash_next(500, "KV load failed")
        response = await self.post("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 500)
        await response.content()
        self.assertEqual([len(d.requests) for d in self.decodes], [1, 0])
        # One request's KV-load failure does not take the instance away.
        self.assertTrue(self.proxy.service.backends.decode.instances[0].healthy)


class StartupHealthTests(ProxyCase):
    async def readiness(self) -> tuple[int, bool]:
        response = await self.http.get(self.proxy.url + "/healthcheck")
        return response.code, json.loads(await response.content())["ready"]

    async def test_with_every_backend_dead_it_is_never_ready_and_never_flaps(self) -> None:
        await self.start(proxy=dict(health_interval=5))
        await self.proxy.stop()
        for fake in (self.prefill, self.decode):
            await fake.stop()
        self.proxy = self.start_proxy([self.prefill.url], [self.decode.url], health_interval=5)
        backends = self.proxy.service.backends
        # Before the first round has answered: not known to be up, so not ready.
        self.assertEqual(await self.readiness(), (503, False))
        await backends.first_round()
        seen = []
        for _ in range(12):  # a minute of rounds, each awaited: down, backoffs past
            seen.append(await self.readiness())
            self.clock.advance(5)
            await backends.check_health()
        self.assertEqual(set(seen), {(503, False)})

    async def test_ready_once_the_first_round_answers(self) -> None:
        await self.start(proxy=dict(health_interval=5))
        await self.proxy.service.backends.first_round()
        self.assertEqual(await self.readiness(), (200, True))

    async def test_health_checks_reuse_their_connection(self) -> None:
        await self.start()
        await self.proxy.stop()
        # Real time here: legs' connections idle out after 50 ms, checks come every 200 ms.
        self.proxy = start_proxy(
            [self.prefill.url], [self.decode.url], listen="tcp:0:interface=127.0.0.1",
            clock=reactor, health_interval=0.2, backend_idle_timeout=0.05,
        )  # fmt: skip
        self.addCleanup(self.proxy.stop)
        for _ in range(4):
            await self.decode.next_health_check()
        self.assertGreaterEqual(self.decode.health_checks, 4)
        self.assertEqual(self.decode.site.connections_accepted, 1)
