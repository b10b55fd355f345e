"""The fake's KV cache events on real ZeroMQ, and its render endpoints, as vLLM 0.32's.

The test's own SUB and DEALER sockets are read by the reactor
(``zmq_reactor.ZmqSocket``); every wait is on a Deferred that fires when a
message arrives, and the subscriber joins before anything is published
(``fake.subscribed()``), so no batch is lost to ZeroMQ's slow joiner.
Absence is shown by order: a batch that should not exist would arrive
before the next one that must.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import zmq
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from nixl_twisted.kv.zmq_reactor import Frames, ZmqSocket
from nixl_twisted.testing import FakeVLLM
from nixl_twisted.testing.prefix_cache import prompt_tokens
from tests.support import Arrivals

END = (-1).to_bytes(8, "big", signed=True)
BLOCK = 4  # tokens a block: a token is 4 bytes of a text prompt, so 16 bytes a block


def seq(number: int) -> bytes:
    return number.to_bytes(8, "big")


def events(frames: Frames) -> list[dict[str, Any]]:
    """A batch's events, checking the batch is vLLM's ``[ts, events, rank 0]``."""
    ts, found, rank = msgpack.unpackb(frames[-1], raw=False)
    assert isinstance(ts, float) and rank == 0
    assert all(isinstance(event, dict) for event in found)
    return list(found)


class Inbox(Arrivals):
    """A ZeroMQ socket of the test's own: each message it receives, one Deferred at a time."""

    def __init__(self, kind: int, endpoint: str) -> None:
        super().__init__()
        self.socket = ZmqSocket(reactor, kind, self.put)
        self.socket.connect(endpoint)
        if kind == zmq.SUB:
            self.socket.subscribe(b"")

    def close(self) -> None:
        self.socket.close()


class KvEventsTests(TestCase):
    timeout = 10  # seconds; each test takes a few milliseconds

    async def publishing(self, **options: Any) -> tuple[FakeVLLM, Inbox]:
        """A fake that publishes, and a subscriber that has joined it."""
        fake = FakeVLLM(kv_events=True, kv_replay=True, block_tokens=BLOCK, **options)
        await fake.listen()
        self.addCleanup(fake.stop)
        subscriber = Inbox(zmq.SUB, f"tcp://127.0.0.1:{fake.kv_events_port}")
        self.addCleanup(subscriber.close)
        await fake.subscribed()
        self.http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        return fake, subscriber

    async def post(self, fake: FakeVLLM, path: str, body: dict[str, Any]) -> Any:
        response = await self.http.post(fake.url + path, json=body)
        answer = json.loads(await response.content())
        self.assertEqual(response.code, 200, answer)
        return answer

    async def complete(self, fake: FakeVLLM, prompt: str) -> None:
        await self.post(fake, "/v1/completions", {"model": "m", "prompt": prompt})

    async def test_once_subscribed_fires_the_subscriber_gets_the_very_next_batch(self) -> None:
        fake = FakeVLLM(kv_events=True)
        await fake.listen()
        self.addCleanup(fake.stop)
        joined = fake.subscribed()
        self.assertFalse(joined.called)  # nobody subscribed yet
        subscriber = Inbox(zmq.SUB, f"tcp://127.0.0.1:{fake.kv_events_port}")
        self.addCleanup(subscriber.close)
        await joined
        fake.clear_cache()  # published at once, no round trip for the connection to settle
        frames = await subscriber.next()
        self.assertEqual(frames[:2], [b"kv", seq(0)])
        self.assertEqual(events(frames), [{"type": "AllBlocksCleared"}])

    async def test_a_computed_prompt_publishes_its_new_blocks_and_a_cached_one_nothing(
        self,
    ) -> None:
        fake, subscriber = await self.publishing()
        first = "The first block!" + "And its second.." + "tail"  # two blocks and a tail
        await self.complete(fake, first)
        frames = await subscriber.next()
        self.assertEqual(frames[:2], [b"kv", seq(0)])
        tokens = prompt_tokens({"prompt": first})
        hashes = fake.cache.block_hashes(tokens)
        self.assertEqual(
            events(frames),
            [
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": None,
                    "token_ids": tokens[: 2 * BLOCK],
                    "block_size": BLOCK,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            ],
        )

        await self.complete(fake, first)  # a cache hit: nothing to publish
        sharing = "The first block!" + "Then another one" + "and a third one."
        await self.complete(fake, sharing)
        frames = await subscriber.next()
        self.assertEqual(frames[1], seq(1))  # the hit sent no batch before it
        (stored,) = events(frames)
        tokens = prompt_tokens({"prompt": sharing})
        self.assertEqual(stored["parent_block_hash"], hashes[0])
        self.assertEqual(stored["block_hashes"], fake.cache.block_hashes(tokens)[1:])
        self.assertEqual(stored["token_ids"], tokens[BLOCK:])
        self.assertEqual((fake.cache.hits, fake.cache.queries), (2 * BLOCK + BLOCK, 9 + 9 + 12))

    async def test_two_fakes_never_agree_on_a_hash(self) -> None:
        one, other = FakeVLLM(), FakeVLLM()
        tokens = list(range(256))
        hashes = set(one.cache.block_hashes(tokens))
        self.assertFalse(hashes & set(other.cache.block_hashes(tokens)))

    async def test_an_eviction_publishes_each_block_removed_then_what_was_stored(self) -> None:
        fake, subscriber = await self.publishing(cache_blocks=2)
        await self.complete(fake, "a" * 32)
        (old,) = events(await subscriber.next())
        await self.complete(fake, "b" * 32)
        batch = events(await subscriber.next())
        head, tail = old["block_hashes"]
        self.assertEqual(
            batch[:2],
            [
                {"type": "BlockRemoved", "block_hashes": [tail], "medium": "GPU", "group_idx": 0},
                {"type": "BlockRemoved", "block_hashes": [head], "medium": "GPU", "group_idx": 0},
            ],
        )
        self.assertEqual([e["type"] for e in batch[2:]], ["BlockStored"])

    async def test_clearing_the_cache_publishes_all_blocks_cleared(self) -> None:
        fake, subscriber = await self.publishing()
        await self.complete(fake, "x" * 16)
        await subscriber.next()
        fake.clear_cache()
        frames = await subscriber.next()
        self.assertEqual(frames[1], seq(1))
        self.assertEqual(events(frames), [{"type": "AllBlocksCleared"}])
        await self.complete(fake, "x" * 16)  # computed again: stored again
        self.assertEqual(events(await subscriber.next())[0]["type"], "BlockStored")

    async def test_a_skipped_batch_is_a_gap_the_replay_fills(self) -> None:
        fake, subscriber = await self.publishing()
        assert fake.kv_publisher is not None
        await self.complete(fake, "zero" * 4)
        await subscriber.next()
        fake.kv_publisher.skip()
        await self.complete(fake, "one!" * 4)  # seq 1: kept, not sent
        await self.complete(fake, "two!" * 4)
        live = await subscriber.next()
        self.assertEqual(live[1], seq(2))

        replay = Inbox(zmq.DEALER, f"tcp://127.0.0.1:{fake.kv_replay_port}")
        self.addCleanup(replay.close)
        replay.socket.send([b"", b"not", b"a request"])  # a wrong frame count: ignored
        replay.socket.send([b"", seq(1)])
        _, skipped = fake.kv_publisher.buffer[1]
        self.assertEqual(await replay.next(), [b"", b"kv", seq(1), skipped])
        self.assertEqual(await replay.next(), [b"", b"kv", seq(2), live[2]])
        self.assertEqual(await replay.next(), [b"", b"", END, b""])
        (stored,) = events([skipped])
        self.assertEqual(stored["token_ids"], prompt_tokens({"prompt": "one!" * 4}))

    async def test_a_replay_from_before_the_buffer_starts_at_its_oldest(self) -> None:
        fake, subscriber = await self.publishing(kv_buffer_steps=2)
        for n in range(3):
            await self.complete(fake, f"prompt number {n}!")  # one block each
            await subscriber.next()
        replay = Inbox(zmq.DEALER, f"tcp://127.0.0.1:{fake.kv_replay_port}")
        self.addCleanup(replay.close)
        replay.socket.send([b"", seq(0)])
        self.assertEqual((await replay.next())[2], seq(1))
        self.assertEqual((await replay.next())[2], seq(2))
        self.assertEqual((await replay.next())[2:], [END, b""])

    async def test_a_restarted_engine_numbers_from_0_again_with_an_empty_cache(self) -> None:
        fake, subscriber = await self.publishing()
        assert fake.kv_publisher is not None
        for prompt in ("first prompt abc", "second prompt ab"):
            await self.complete(fake, prompt)
            await subscriber.next()
        fake.restart_engine()
        self.assertEqual(len(fake.kv_publisher.buffer), 0)
        await self.complete(fake, "first prompt abc")  # computed anew: stored anew
        frames = await subscriber.next()
        self.assertEqual(frames[1], seq(0))
        self.assertEqual(events(frames)[0]["type"], "BlockStored")

    async def test_render_answers_the_token_ids_the_events_carry(self) -> None:
        fake, subscriber = await self.publishing()
        prompt = "Render me, then compute me please"
        (rendered,) = await self.post(
            fake, "/v1/completions/render", {"model": "m", "prompt": prompt}
        )
        self.assertEqual(set(rendered), {"request_id", "token_ids"})
        self.assertTrue(rendered["request_id"].startswith("cmpl-"))
        await self.complete(fake, prompt)
        (stored,) = events(await subscriber.next())
        self.assertEqual(rendered["token_ids"][: 2 * BLOCK], stored["token_ids"])
        self.assertEqual(rendered["token_ids"], prompt_tokens({"prompt": prompt}))

        chat = {"model": "m", "messages": [{"role": "user", "content": "What is held?" * 3}]}
        answer = await self.post(fake, "/v1/chat/completions/render", chat)
        self.assertTrue(answer["request_id"].startswith("chatcmpl-"))
        await self.post(fake, "/v1/chat/completions", chat)
        (stored,) = events(await subscriber.next())
        whole = len(answer["token_ids"]) // BLOCK * BLOCK
        self.assertEqual(answer["token_ids"][:whole], stored["token_ids"])
        tokenized = await self.post(fake, "/tokenize", chat)
        self.assertEqual(tokenized["tokens"], answer["token_ids"])

        batch = await self.post(fake, "/v1/completions/render", {"prompt": ["one", [7, 8]]})
        one = prompt_tokens({"prompt": "one"})
        self.assertEqual([r["token_ids"] for r in batch], [one, [7, 8]])
        paths = [r.path for r in fake.requests_for("other")]
        self.assertEqual(paths.count("/v1/completions/render"), 2)
        self.assertEqual(paths.count("/v1/chat/completions/render"), 1)

    async def test_render_fails_as_told(self) -> None:
        fake = FakeVLLM(render_status=404)
        await fake.listen()
        self.addCleanup(fake.stop)
        http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        response = await http.post(fake.url + "/v1/completions/render", json={"prompt": "x"})
        self.assertEqual(response.code, 404)
        self.assertEqual(json.loads(await response.content()), {"detail": "Not Found"})
        self.assertEqual(fake.requests_for("other")[0].path, "/v1/completions/render")

    async def test_a_fake_without_kv_events_has_no_ports(self) -> None:
        fake = FakeVLLM()
        await fake.listen()
        self.addCleanup(fake.stop)
        self.assertEqual((fake.kv_events_port, fake.kv_replay_port), (None, None))
        with self.assertRaises(RuntimeError):
            fake.subscribed()
        only_events = FakeVLLM(kv_events=True)
        await only_events.listen()
        self.addCleanup(only_events.stop)
        self.assertIsNotNone(only_events.kv_events_port)
        self.assertIsNone(only_events.kv_replay_port)
