"""Fake clusters on loopback: every instance listening, and none left if one cannot.

The ledger is proved pure (``tests/pure/test_ledger.py``) and a fake decode
refusing rebuilt params in memory (``tests/memory/test_fakes.py``).
"""

from __future__ import annotations

import json

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.error import CannotListenError
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.testing import FakeVLLM, start_cluster


class FakeClusterTests(TestCase):
    async def test_every_decode_redeems_what_any_prefill_issued(self) -> None:
        cluster = await start_cluster(
            ["tcp:0:interface=127.0.0.1"] * 2, ["tcp:0:interface=127.0.0.1"] * 2, reactor
        )
        self.addCleanup(cluster.stop)
        self.assertEqual(
            [f.name for f in cluster.instances], ["prefill-0", "prefill-1", "decode-0", "decode-1"]
        )
        self.assertEqual({id(f.ledger) for f in cluster.instances}, {id(cluster.ledger)})
        http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))

        for prefill, decode in zip(cluster.prefills, reversed(cluster.decodes), strict=True):
            answer = await http.post(
                prefill.url + "/v1/completions",
                json={"prompt": "a b c", "kv_transfer_params": {"do_remote_decode": True}},
            )
            params = json.loads(await answer.content())["kv_transfer_params"]
            self.assertEqual(params["remote_engine_id"], prefill.name)
            answer = await http.post(
                decode.url + "/v1/completions",
                json={"prompt": "a b c", "kv_transfer_params": params},
            )
            self.assertEqual(answer.code, 200, await answer.content())
        self.assertEqual(len(cluster.ledger.redeemed), 2)

    async def test_one_that_cannot_listen_stops_those_that_did(self) -> None:
        taken = FakeVLLM()
        await taken.listen()
        self.addCleanup(taken.stop)
        port = taken.url.rsplit(":", 1)[1]
        with self.assertRaises(CannotListenError):
            await start_cluster(
                ["tcp:0:interface=127.0.0.1"], [f"tcp:{port}:interface=127.0.0.1"], reactor
            )
        # The prefill that listened is stopped: trial's clean-reactor check
        # fails this test if its port were left open.
