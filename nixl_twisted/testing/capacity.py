"""A fake vLLM's capacity: how many requests run at once, and the queue the rest wait in.

vLLM runs at most ``--max-num-seqs`` requests at a time; the others wait in
its scheduler's waiting queue, first come first served, and start as
running ones end. Since 0.32 it also refuses a request with 503 when
``--max-num-queued-reqs`` would be exceeded (requests waiting or running,
counted in its API server before the request reaches the engine), "so that
load balancers retry on a different instance". ``FakeVLLM`` inherits this;
both are off unless the fake is given them.
"""

from __future__ import annotations

from collections import deque

from twisted.internet.defer import Deferred, succeed

#: vLLM 0.32's message when ``--max-num-queued-reqs`` would be exceeded (``QueueOverflowError``).
QUEUE_FULL = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
#: Its error ``type``: the status's phrase, as vLLM writes it for this error.
QUEUE_FULL_TYPE = "Service Unavailable"


class Capacity:
    """Mixed into ``FakeVLLM``, whose fields these read and whose gauges they move.

    ``running`` and ``waiting`` are what ``/metrics`` reports; a test may set
    them (a load the fake does not model), and the requests the fake serves
    move them up and down from there. The fake's own decisions count its
    own requests only.
    """

    max_num_seqs: int
    max_num_queued_reqs: int | None
    running: int
    waiting: int

    def __init__(self) -> None:
        #: Requests holding a slot (running), and those waiting for one, oldest first.
        self._seated = 0
        self._queue: deque[Deferred[None]] = deque()

    def _admits(self) -> bool:
        """Whether one more request fits under ``max_num_queued_reqs`` (waiting or running)."""
        limit = self.max_num_queued_reqs
        return limit is None or self._seated + len(self._queue) < limit

    def _has_room(self) -> bool:
        return not self.max_num_seqs or self._seated < self.max_num_seqs

    def _take_slot(self) -> Deferred[None]:
        """Fires once the request may run: at once while there is room and nobody
        waits, else when the requests before it have started and a slot is free.

        Cancelling it (Klein does when the client goes away) takes the request
        out of the queue.
        """
        if self._has_room() and not self._queue:
            self._seat()
            return succeed(None)
        turn: Deferred[None] = Deferred(self._leave)
        self._queue.append(turn)
        self.waiting += 1
        return turn

    def _leave(self, turn: Deferred[None]) -> None:
        self._queue.remove(turn)
        self.waiting -= 1

    def _seat(self) -> None:
        self._seated += 1
        self.running += 1

    def _release_slot(self) -> None:
        """A running request ended: the first waiting ones start, as many as have room."""
        self._seated -= 1
        self.running -= 1
        while self._queue and self._has_room():
            turn = self._queue.popleft()
            self.waiting -= 1
            self._seat()
            turn.callback(None)
