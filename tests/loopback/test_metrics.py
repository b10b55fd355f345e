"""/metrics after real requests, and the one access-log event per request."""

from __future__ import annotations

import json
from typing import cast

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import gatherResults
from twisted.internet.interfaces import IPushProducer
from twisted.logger import formatEvent
from twisted.web.client import ResponseFailed

from nixl_twisted.observe.access import access_line
from tests.support import CHAT, ProxyCase, closed_port_url

STREAM = dict(CHAT, stream=True)
Key = tuple[str, tuple[tuple[str, str], ...]]


class ScrapingCase(ProxyCase):
    async def scrape(
        self, url: str | None = None
    ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        response = await self.http.get((url or self.proxy.url) + "/metrics")
        self.assertEqual(response.code, 200)
        self.assertTrue(
            response.headers.getRawHeaders(b"content-type")[0].startswith(b"text/plain")
        )
        samples = {}
        for family in text_string_to_metric_families((await response.content()).decode()):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples


class MetricsTests(ScrapingCase):
    async def test_counters_histograms_and_gauges_move_with_real_requests(self) -> None:
        await self.start(prefills=2, proxy=dict(unhealthy_threshold=1))
        p0, p1 = (p.url for p in self.prefills)
        decode = self.decode.url
        for _ in range(2):
            response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.prefills[0].crash_next(503)  # retried on prefill-1
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 200)
        self.prefills[1].omit_kv_transfer_params_next()  # prefill-0 is down now
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 502)
        await self.post_json("/v1/completions", b"[]")

        # One stream held open, then left by its client.
        collector = await self.held_stream()
        during = await self.scrape()
        cast(IPushProducer, collector.transport).stopProducing()
        with self.assertRaises(ResponseFailed):
            await collector.done
        (channel,) = self.decode.site.channels()
        await self.decode.site.connection_lost(channel)
        self.decode.release()

        m = await self.scrape()

        def value(name: str, **labels: str) -> float:
            return m.get((name, tuple(sorted(labels.items()))), 0.0)

        self.assertEqual(during[("nixlproxy_requests_in_flight", ())], 1)
        self.assertEqual(value("nixlproxy_requests_in_flight"), 0)
        chat = "/v1/chat/completions"
        self.assertEqual(value("nixlproxy_requests_total", route=chat, status="200"), 3)
        self.assertEqual(value("nixlproxy_requests_total", route=chat, status="502"), 1)
        self.assertEqual(value("nixlproxy_requests_total", route=chat, status="client_left"), 1)
        self.assertEqual(
            value("nixlproxy_requests_total", route="/v1/completions", status="400"), 1
        )

        def legs(pool: str, instance: str, outcome: str) -> float:
            return value(
                "nixlproxy_backend_requests_total", pool=pool, instance=instance, outcome=outcome
            )

        self.assertEqual(legs("prefill", p0, "answered"), 1)
        self.assertEqual(legs("prefill", p0, "error_status"), 1)
        self.assertEqual(legs("prefill", p1, "answered"), 4)
        self.assertEqual(legs("decode", decode, "answered"), 4)
        self.assertEqual(value("nixlproxy_retries_total", pool="prefill"), 1)
        self.assertEqual(value("nixlproxy_prefill_missing_kv_transfer_params_total"), 1)
        self.assertEqual(value("nixlproxy_client_disconnects_total", phase="relay"), 1)
        # Each leg's latency by the instance that answered with params.
        self.assertEqual(value("nixlproxy_prefill_seconds_count", instance=p0), 1)
        self.assertEqual(value("nixlproxy_prefill_seconds_count", instance=p1), 3)
        self.assertEqual(value("nixlproxy_decode_first_byte_seconds_count", instance=decode), 4)
        self.assertFalse([key for key in m if key[0].endswith("_created")])
        # Every completion that got an answer: three 200s, the 502 and the 400.
        self.assertEqual(value("nixlproxy_request_seconds_count"), 5)
        # prefill-0 answered 503: it is out of rotation, and the gauge says so.
        self.assertEqual(value("nixlproxy_backend_healthy", pool="prefill", instance=p0), 0)
        self.assertEqual(value("nixlproxy_backend_healthy", pool="decode", instance=decode), 1)
        # No request id, no prompt, ever, as a label.
        labels = {v for key in m for _, v in key[1]}
        for request in self.decode.requests:
            self.assertNotIn(request.request_id, labels)
        self.assertFalse(any("hello there" in label for label in labels))

    async def test_a_separate_metrics_endpoint(self) -> None:
        await self.start(proxy=dict(metrics_listen="tcp:0:interface=127.0.0.1"))
        hidden = await self.http.get(self.proxy.url + "/metrics")
        self.assertEqual(hidden.code, 404)
        await hidden.content()
        _, metrics_port = self.proxy.service.ports()  # --listen first, then --metrics-listen
        metrics_url = f"http://127.0.0.1:{metrics_port.getHost().port}"  # type: ignore[attr-defined]
        await self.post_json("/v1/completions", {"model": "m", "prompt": "x"})
        m = await self.scrape(metrics_url)
        key = ("nixlproxy_requests_total", (("route", "/v1/completions"), ("status", "200")))
        self.assertEqual(m[key], 1)


class AccessLogTests(ScrapingCase):
    async def test_one_event_per_request_with_both_legs(self) -> None:
        events = self.access_events()
        await self.start()
        response = await self.post("/v1/chat/completions", CHAT)
        body = await response.content()
        await self.post_json("/v1/chat/completions", b"{")
        health = await self.http.get(self.proxy.url + "/healthcheck")
        await health.content()

        self.assertEqual(len(events), 3)
        first, second, third = events
        (request_id,) = response.headers.getRawHeaders(b"x-request-id")
        self.assertEqual(first["request_id"], request_id.decode())
        self.assertEqual(first["path"], "/v1/chat/completions")
        self.assertEqual(first["method"], "POST")
        self.assertEqual(first["status"], 200)
        self.assertEqual(first["prefill"], self.prefill.url)
        self.assertEqual(first["decode"], self.decode.url)
        self.assertEqual((first["prefill_status"], first["decode_status"]), (200, 200))
        self.assertIsInstance(first["prefill_ms"], int)
        self.assertIsInstance(first["decode_ttfb_ms"], int)
        self.assertEqual(first["bytes"], len(body))
        self.assertNotIn("ended", first)  # answered: the usual ending is not said
        self.assertTrue(first["client"].startswith("127.0.0.1:"))
        self.assertEqual(second["status"], 400)
        self.assertNotIn("prefill", second)  # what did not happen is left out
        self.assertEqual(third["path"], "/healthcheck")
        json.dumps(events)

    async def test_access_log_off_emits_no_event_and_still_counts(self) -> None:
        events = self.access_events()
        await self.start(proxy=dict(access_log="off"))
        for _ in range(2):
            response, _ = await self.post_json("/v1/chat/completions", CHAT)
            self.assertEqual(response.code, 200)
        samples = await self.scrape()
        self.assertEqual(events, [])
        key = (
            "nixlproxy_requests_total",
            (("route", "/v1/chat/completions"), ("status", "200")),
        )
        self.assertEqual(samples[key], 2)

    async def test_a_client_that_leaves_gets_its_event_too(self) -> None:
        events = self.access_events()
        await self.start()
        collector = await self.held_stream()
        (channel,) = self.proxy.site.channels()
        lost = self.proxy.site.connection_lost(channel)
        cast(IPushProducer, collector.transport).stopProducing()
        with self.assertRaises(ResponseFailed):
            await collector.done
        await lost
        self.decode.release()
        (event,) = events
        self.assertEqual(event["ended"], "client_left")
        self.assertEqual(event["decode"], self.decode.url)

    async def test_a_404_keeps_its_path_bounded(self) -> None:
        events = self.access_events()
        await self.start()
        response = await self.post("/v2/" + "x" * 300, CHAT)
        await response.content()
        (event,) = events
        self.assertEqual(event["status"], 404)
        self.assertEqual(event["path"], "/v2/" + "x" * 196 + "...")


class AccessEventDetailTests(ScrapingCase):
    async def test_the_model_and_the_usage_decode_reported(self) -> None:
        events = self.access_events()
        await self.start()
        _, answer = await self.post_json("/v1/chat/completions", CHAT)
        stream = await self.post("/v1/completions", {
            "model": "m\ud800", "prompt": "one two three", "stream": True,
            "stream_options": {"include_usage": True},
        })  # fmt: skip
        await stream.content()
        whole, streamed = events
        usage = answer["usage"]
        self.assertEqual(whole["model"], "fake-model")
        self.assertEqual(
            (whole["prompt_tokens"], whole["completion_tokens"], whole["cached_tokens"]),
            (usage["prompt_tokens"], usage["completion_tokens"],
             usage["prompt_tokens_details"]["cached_tokens"]),
        )  # fmt: skip
        self.assertEqual(streamed["model"], "m\\ud800")  # a lone surrogate, escaped
        self.assertEqual(streamed["prompt_tokens"], 3)
        self.assertIn("tokens=(", access_line(streamed))

    async def test_every_attempt_of_each_leg_is_listed(self) -> None:
        events = self.access_events()
        await self.start(prefills=2, decodes=1, proxy=dict(decode_retries=1))
        dead = await closed_port_url()
        self.proxy.service.backends.decode.add(dead)
        self.proxy.service.backends.decode.instances.reverse()  # the dead one first
        self.prefills[0].crash_next(503)
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 200)
        (event,) = events
        p0, p1 = (fake.url for fake in self.prefills)
        self.assertEqual(event["attempts"], [
            f"prefill {p0} error_status", f"prefill {p1} answered",
            f"decode {dead} unreachable", f"decode {self.decode.url} answered",
        ])  # fmt: skip
        self.assertIn(f"attempts=[prefill {p0} error_status; ", access_line(event))

    async def test_a_batch_lists_each_parts_legs_and_sums_their_usage(self) -> None:
        events = self.access_events()
        await self.start()
        body = {"model": "m", "prompt": ["one", "two three"], "max_tokens": 2}
        response, answer = await self.post_json("/v1/completions", body)
        self.assertEqual(response.code, 200)
        (event,) = events
        self.assertEqual(len(event["parts"]), 2)
        for index, part in enumerate(event["parts"]):
            self.assertTrue(part.startswith(f"{index}: "), part)
            self.assertIn(f"prefill={self.prefill.url} (200)", part)
            self.assertIn(f"decode={self.decode.url} (200)", part)
        self.assertEqual(event["prompt_tokens"], answer["usage"]["prompt_tokens"])
        self.assertEqual(event["completion_tokens"], 4)

    async def test_a_decode_break_is_not_told_as_the_client_leaving(self) -> None:
        logged = self.logged()
        events = self.access_events()
        await self.start()
        self.decode.break_next(after_events=2)
        response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))
        # The proxy closes the connection (its event written as it does), maybe already.
        closing = [self.proxy.site.connection_lost(c) for c in self.proxy.site.channels()]
        with self.assertRaises(ResponseFailed):
            await response.content()
        await gatherResults(closing)
        lines = [formatEvent(e) for e in logged]
        self.assertTrue(any("broke off" in line for line in lines), lines)
        self.assertFalse(any("client left" in line for line in lines), lines)
        (event,) = events
        self.assertEqual(event["ended"], "broken")
        samples = await self.scrape()
        self.assertNotIn(("nixlproxy_client_disconnects_total", (("phase", "relay"),)), samples)


class QuietLogTests(ProxyCase):
    async def test_no_factory_chatter_for_backend_connections(self) -> None:
        logged = self.logged()
        await self.start()
        for _ in range(2):
            response, _ = await self.post_json("/v1/chat/completions", CHAT)
            self.assertEqual(response.code, 200)
        await self.proxy.stop()  # closing the pooled connections, which logged "Stopping"
        events = [formatEvent(event) for event in logged]
        self.assertTrue(any("nixlproxy" in line for line in events))  # it did log
        backends = [f.url.removeprefix("http://") for f in (self.prefill, self.decode)]
        chatter = [
            e
            for e in events
            if ("_HTTP11ClientFactory" in e and any(b in e for b in backends))
            or ("Starting factory" in e and "TrackingSite" in e)
        ]
        self.assertEqual(chatter, [])


class TimeToFirstByteTests(ScrapingCase):
    async def test_the_client_ttfb_and_handoff_gap_are_observed_per_route(self) -> None:
        await self.start(tokens=3)
        response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))
        await response.content()
        response, _ = await self.post_json("/v1/completions", {"model": "m", "prompt": "x"})
        m = await self.scrape()
        for route in ("/v1/chat/completions", "/v1/completions"):
            key = ("nixlproxy_time_to_first_byte_seconds_count", (("route", route),))
            self.assertEqual(m[key], 1)
        self.assertEqual(m[("nixlproxy_handoff_gap_seconds_count", ())], 2)
        self.assertEqual(m.get(("nixlproxy_handoff_gap_over_warning_total", ()), 0), 0)
