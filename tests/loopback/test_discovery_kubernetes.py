"""Kubernetes discovery against ``FakeKubernetes``: pods listed, then watched, over real HTTP.

The proxy reads a kubeconfig naming the fake (a token, a namespace) and
selects the decode pods by label; each pod's vLLM is a fake on loopback
at its named container port.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.discovery.service import Discovery
from nixl_twisted.testing import FakeKubernetes, FakeVLLM, TransferLedger
from tests.support import CHAT, ProxyCase

SELECTOR = "app=vllm,role=decode"
LABELS = {"app": "vllm", "role": "decode"}


class KubernetesDiscoveryTests(ProxyCase):
    async def begin(self, token: str = "s3cret", pods: int = 2, **settings: object) -> None:
        self.ledger = TransferLedger()
        self.clock = Clock()
        self.k8s = FakeKubernetes(namespace="serving", token="s3cret")
        await self.k8s.listen()
        self.addCleanup(self.k8s.stop)
        self.decodes = []
        for i in range(pods):
            fake = FakeVLLM(name=f"decode-{i}", ledger=self.ledger)
            await fake.listen()
            self.addCleanup(fake.stop)
            self.decodes.append(fake)
        self.prefills = [FakeVLLM(name="prefill", ledger=self.ledger)]
        await self.prefill.listen()
        self.addCleanup(self.prefill.stop)
        where = Path(tempfile.mkdtemp(prefix="nixlproxy-kubeconfig-"))
        self.addCleanup(shutil.rmtree, where)
        config = where / "config"
        config.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
            "contexts: [{name: test, context: {cluster: fake, user: proxy, namespace: serving}}]\n"
            f"clusters: [{{name: fake, cluster: {{server: '{self.k8s.url}'}}}}]\n"
            f"users: [{{name: proxy, user: {{token: {token}}}}}]\n"
        )
        self.config = str(config)
        self.settings: dict[str, Any] = dict(
            decode_selector=SELECTOR, kubeconfig=self.config, kubernetes_port="http", **settings
        )
        self.http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))

    def run_proxy(self) -> None:
        self.proxy = self.start_proxy([self.prefill.url], [], **self.settings)

    def pod(self, i: int, ready: bool = True, labels: dict[str, str] = LABELS) -> None:
        port = int(self.decodes[i].url.rsplit(":", 1)[1])
        self.k8s.add_pod(f"decode-{i}", labels, "127.0.0.1", ready=ready, ports={"http": port})

    def discovery(self) -> Discovery:
        found = self.proxy.service.discovery
        assert found is not None
        return found

    def serving(self) -> list[str]:
        return sorted(i.url for i in self.proxy.service.backends.decode.instances if not i.draining)

    async def until_serving(self, *fakes: int) -> None:
        wanted = sorted(self.decodes[i].url for i in fakes)
        while self.serving() != wanted:
            await self.discovery().changed()

    async def chat(self) -> int:
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        return int(response.code)

    def watches(self) -> list[dict[str, list[str]]]:
        return [args for _, args in self.k8s.requests if args.get("watch") == ["1"]]

    async def test_ready_pods_are_the_pool_as_they_come_change_and_go(self) -> None:
        await self.begin(pods=3)
        self.pod(0)
        self.pod(1, ready=False)
        self.run_proxy()
        await self.until_serving(0)
        (listing, *_) = self.k8s.requests
        self.assertEqual(listing[0], "/api/v1/namespaces/serving/pods")
        self.assertEqual(listing[1]["labelSelector"], [SELECTOR])

        self.k8s.set_ready("decode-1", True)  # MODIFIED: ready now
        await self.until_serving(0, 1)
        self.pod(2, labels={"app": "vllm", "role": "prefill"})  # another selector's
        self.assertEqual([await self.chat() for _ in range(4)], [200] * 4)
        self.assertEqual([len(f.requests) for f in self.decodes], [2, 2, 0])

        self.k8s.set_labels("decode-0", {"app": "vllm", "role": "canary"})  # out of the selector
        await self.until_serving(1)
        self.k8s.terminate("decode-1")  # terminating: no new legs
        self.k8s.set_labels("decode-2", LABELS)  # into it
        await self.until_serving(2)
        self.assertEqual(await self.chat(), 200)
        self.assertEqual([len(f.requests) for f in self.decodes], [2, 2, 1])

        health = json.loads(await (await self.http.get(self.proxy.url + "/healthcheck")).content())
        (source,) = health["sources"]
        self.assertEqual(
            (source["source"], source["name"], source["state"], source["instances"]),
            ("kubernetes", f"kubernetes:serving/{SELECTOR}", "ok", 1),
        )
        self.assertEqual({i["source"] for i in health["instances"]["decode"]}, {"kubernetes"})

    async def test_a_watch_resumes_from_the_last_version_and_relists_when_gone(self) -> None:
        await self.begin(pods=2)
        self.pod(0)
        watching = self.k8s.watching()
        self.run_proxy()
        await self.until_serving(0)
        await watching
        self.pod(1)
        await self.until_serving(0, 1)  # (the watch's event: its version is the latest)
        seen = self.k8s.resource_version

        # A dropped watch: counted, then watched again from the last version, not listed.
        noticed, watching = self.discovery().noticed(), self.k8s.watching()
        self.k8s.drop_watches()
        await noticed
        self.clock.advance(1)  # the backoff after an error
        self.assertEqual(await watching, int(seen))
        self.assertEqual(self.watches()[-1]["resourceVersion"], [seen])
        self.assertEqual(len(self.lists()), 1)

        # 410 as an ERROR event on the open watch: listed afresh, then watched.
        watching = self.k8s.watching()
        self.k8s.expire(error_event=True)
        await watching
        self.assertEqual(len(self.lists()), 2)
        self.assertEqual(self.serving(), sorted(f.url for f in self.decodes))

        # 410 on the watch request: its version expired while it was away.
        noticed = self.discovery().noticed()
        self.k8s.drop_watches()
        await noticed
        self.k8s.delete_pod("decode-0")  # (unseen: nobody watches)
        self.k8s.expire()
        watching = self.k8s.watching()
        self.clock.advance(2)
        await watching
        self.assertEqual(len(self.lists()), 3)
        self.assertEqual(self.serving(), [self.decodes[1].url])
        self.assertEqual(await self.chat(), 200)

    def lists(self) -> list[dict[str, list[str]]]:
        return [args for _, args in self.k8s.requests if "watch" not in args]

    async def test_a_refused_token_keeps_nothing_and_says_why(self) -> None:
        await self.begin(token="wrong", pods=1)
        self.pod(0)
        self.run_proxy()
        while not self.discovery().sources() or (
            self.discovery().sources()[0]["state"] != "failing"
        ):
            await self.discovery().noticed()
        (source,) = self.discovery().sources()
        self.assertIn("401", source["last_error"])
        self.assertEqual(self.serving(), [])
        self.assertEqual(await self.chat(), 503)
