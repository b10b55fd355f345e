"""A ZeroMQ socket in the reactor, on real loopback sockets: whatever comes, it reads on.

Every wait is on a Deferred a message or a connection event fires: an XPUB
says when a subscriber has joined (``XPUB_VERBOSE``), so nothing is sent
before it can arrive.
"""

from __future__ import annotations

from typing import Any

import zmq
from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from nixl_twisted.kv.zmq_reactor import Frames, ZmqSocket
from tests.support import Arrivals


class ZmqSocketTests(TestCase):
    timeout = 10

    async def pair(
        self, **subscriber: Any
    ) -> tuple[ZmqSocket, Arrivals, ZmqSocket, Arrivals, Arrivals]:
        """A publisher, its subscriptions, a subscriber that has joined, what it got, and
        its connections made (True) and lost (False)."""
        joined, got, connections = Arrivals(), Arrivals(), Arrivals()
        publisher = ZmqSocket(reactor, zmq.XPUB, lambda frames: joined.put(frames[0][:1]))
        assert publisher.socket is not None
        publisher.socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.addCleanup(publisher.close)
        port = publisher.bind("tcp://127.0.0.1:0")
        sub = ZmqSocket(reactor, zmq.SUB, got.put, **subscriber)
        self.addCleanup(sub.close)
        sub.watch(connections.put)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.subscribe(b"")
        self.assertEqual(await joined.next(), b"\x01")
        return publisher, joined, sub, got, connections

    async def test_a_reader_that_raises_does_not_close_its_socket(self) -> None:
        seen: list[Frames] = []
        publisher, _, sub, got, _ = await self.pair()

        def reader(frames: Frames) -> None:
            seen.append(frames)
            if frames == [b"bad"]:
                raise ValueError("a reader's own mistake")
            got.put(frames)

        sub.received = reader
        publisher.send([b"bad"])
        publisher.send([b"good"])
        self.assertEqual(await got.next(), [b"good"])
        self.assertEqual(seen, [[b"bad"], [b"good"]])
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)  # logged, not lost

    async def test_a_paused_socket_holds_what_comes_until_resumed(self) -> None:
        publisher, _, sub, got, _ = await self.pair()
        sub.pause()
        publisher.send([b"one"])
        publisher.send([b"two"])
        publisher.send([b"three"])
        assert sub.socket is not None
        self.assertTrue(sub.socket.poll(5000))  # (returns once ZeroMQ holds one)
        sub.doRead()  # as the reactor would: nothing is taken while paused
        self.assertEqual(got.arrived, [])
        sub.resume()
        self.assertEqual([await got.next() for _ in range(3)], [[b"one"], [b"two"], [b"three"]])

    async def test_a_message_over_the_cap_drops_the_connection_which_is_made_again(
        self,
    ) -> None:
        publisher, joined, _, got, connections = await self.pair(max_message=1000)
        self.assertIs(await connections.next(), True)
        publisher.send([b"x" * 1001])  # ZeroMQ refuses it: nothing reaches Python
        self.assertIs(await connections.next(), False)
        self.assertEqual(await joined.next(), b"\x00")  # (the publisher sees it leave)
        self.assertEqual(await joined.next(), b"\x01")  # and come back
        self.assertIs(await connections.next(), True)
        publisher.send([b"x" * 1000])
        self.assertEqual(await got.next(), [b"x" * 1000])
        self.assertEqual(got.arrived, [])
