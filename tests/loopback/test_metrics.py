"""/metrics on a port of its own, and no log chatter from real backend connections.

The metrics and access events of requests are proved in memory
(``tests/memory/test_metrics.py``).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from twisted.logger import formatEvent

from tests.support import CHAT, ProxyCase


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


class MetricsEndpointTests(ScrapingCase):
    async def test_a_separate_metrics_endpoint(self) -> None:
        await self.start(proxy=dict(metrics_listen="tcp:0:interface=127.0.0.1"))
        hidden = await self.http.get(self.proxy.url + "/metrics")
        self.assertEqual(hidden.code, 404)
        await hidden.content()
        _, metrics_port = self.proxy.service.ports()  # --listen first, then --metrics-listen
        metrics_url = f"http://127.0.0.1:{metrics_port.getHost().port}"  # type: ignore[attr-defined]
        await self.post_json("/v1/completions", {"model": "m", "prompt": "x"})
        m = await self.scrape(metrics_url)
        key = (
            "nixlproxy_requests_total",
            (("model", ""), ("route", "/v1/completions"), ("status", "200")),
        )
        self.assertEqual(m[key], 1)


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
