"""Fake clusters on loopback: every instance listening, and none left if one cannot.

The ledger is proved pure (``tests/pure/test_ledger.py``) and a fake decode
refusing rebuilt params in memory (``tests/memory/test_fakes.py``).
"""

from __future__ import annotations

import json
import shutil
import tempfile

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.error import CannotListenError
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.testing import FakeVLLM, SharedLedger, start_cluster


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

    async def test_a_handle_one_fleet_decode_issued_is_read_once_by_anothers_prefill(
        self,
    ) -> None:
        directory = tempfile.mkdtemp(prefix="nixl-fake-ledger-")
        self.addCleanup(shutil.rmtree, directory)
        one, other = [
            await start_cluster(
                ["tcp:0:interface=127.0.0.1"],
                ["tcp:0:interface=127.0.0.1"],
                reactor,
                SharedLedger(directory),  # (as two processes given one --ledger)
                bidirectional=True,
            )
            for _ in range(2)
        ]
        self.addCleanup(one.stop)
        self.addCleanup(other.stop)
        http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))

        async def legs(prefill: FakeVLLM, prompt: list[int], params: object) -> object:
            lowered = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params}
            answer = await http.post(prefill.url + "/v1/completions", json=lowered)
            said = json.loads(await answer.content())["kv_transfer_params"]
            leg = {"prompt": prompt, "kv_transfer_params": said}
            answer = await http.post(one.decodes[0].url + "/v1/completions", json=leg)
            self.assertEqual(answer.code, 200)
            return json.loads(await answer.content())

        first = await legs(one.prefills[0], [5, 6, 7], {"do_remote_decode": True})
        assert isinstance(first, dict)
        handle = first["kv_transfer_params"]
        self.assertEqual(handle, one.decodes[0].handles_issued[0])
        following = [5, 6, 7, *range(1 << 40, (1 << 40) + 8), 9]  # (what decode held, then more)
        await legs(other.prefills[0], following, handle)
        await legs(one.prefills[0], following, handle)
        (read,) = other.prefills[0].handles_read
        self.assertEqual((read["pulled"], read["again"]), (handle["remote_num_tokens"], False))
        self.assertTrue(one.prefills[0].handles_read[0]["again"])

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
