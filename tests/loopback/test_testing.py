"""The fake vLLM itself: it must catch a proxy that gets the protocol wrong."""

from __future__ import annotations

import json

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.error import CannotListenError
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.testing import FakeVLLM, TransferLedger, start_cluster, start_pair


def test_redeem_accepts_exactly_what_was_issued_once() -> None:
    ledger = TransferLedger()
    params = ledger.issue("engine", "r1", prompt_tokens=40, kv_port=5600)
    assert ledger.redeem(json.loads(json.dumps(params))) is None
    assert ledger.redeem(params) == "no prefill issued these kv_transfer_params"


def test_redeem_refuses_params_missing_a_key() -> None:
    ledger = TransferLedger()
    params = dict(ledger.issue("engine", "r1", prompt_tokens=40, kv_port=5600))
    del params["remote_prefill_cached_tokens"]
    assert ledger.redeem(params) == "kv_transfer_params differ from what prefill issued"


def test_issued_params_look_like_current_vllm() -> None:
    params = TransferLedger().issue("engine", "r1", prompt_tokens=40, kv_port=5600)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[0, 1, 2], [100, 101, 102]]
    assert params["remote_request_id"].startswith("r1-")
    for key in ("tp_size", "transfer_mode", "remote_prefill_cached_tokens", "remote_num_tokens"):
        assert key in params


class FakePairTests(TestCase):
    async def test_decode_refuses_rebuilt_params_as_a_kv_load_failure(self) -> None:
        pair = await start_pair(reactor)
        self.addCleanup(pair.stop)
        pool = HTTPConnectionPool(reactor)
        self.addCleanup(pool.closeCachedConnections)
        http = HTTPClient(Agent(reactor, pool=pool))

        prefill = await http.post(
            pair.prefill.url + "/v1/completions",
            json={"prompt": "a b c", "kv_transfer_params": {"do_remote_decode": True}},
        )
        params = json.loads(await prefill.content())["kv_transfer_params"]
        rebuilt = {k: params[k] for k in ("remote_engine_id", "remote_request_id")}
        rebuilt["do_remote_prefill"] = True
        decode = await http.post(
            pair.decode.url + "/v1/completions",
            json={"prompt": "a b c", "kv_transfer_params": rebuilt},
        )
        self.assertEqual(decode.code, 500)
        self.assertIn("KV load failed", json.loads(await decode.content())["error"]["message"])

        decode = await http.post(
            pair.decode.url + "/v1/completions",
            json={"prompt": "a b c", "kv_transfer_params": params},
        )
        self.assertEqual(decode.code, 200)
        await decode.content()
        self.assertEqual([r.role for r in pair.prefill.requests], ["prefill"])
        self.assertEqual([r.role for r in pair.decode.requests], ["decode", "decode"])


class FakeClusterTests(TestCase):
    async def test_every_decode_redeems_what_any_prefill_issued(self) -> None:
        cluster = await start_cluster(["tcp:0:interface=127.0.0.1"] * 2,
                                      ["tcp:0:interface=127.0.0.1"] * 2, reactor)  # fmt: skip
        self.addCleanup(cluster.stop)
        self.assertEqual([f.name for f in cluster.instances],
                         ["prefill-0", "prefill-1", "decode-0", "decode-1"])  # fmt: skip
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
            await start_cluster(["tcp:0:interface=127.0.0.1"],
                                [f"tcp:{port}:interface=127.0.0.1"], reactor)  # fmt: skip
        # The prefill that listened is stopped: trial's clean-reactor check
        # fails this test if its port were left open.
