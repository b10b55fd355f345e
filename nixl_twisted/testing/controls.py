"""What a test tells a ``FakeVLLM``: scripted answers, holds, a firehose, health waits.

``FakeVLLM`` inherits these controls; they are apart so that the fake's
serving reads on its own.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.web.server import Request
from zope.interface import implementer

from nixl_twisted.testing.behaviours import (
    Behaviour,
    ErrorAnswer,
    RawAnswer,
    break_off,
    die_after,
    end_after,
    fail_after,
    omit_kv_transfer_params,
    other_prompt_ids,
    spoil_kv_transfer_params,
)


class Controls:
    """The knobs of a fake instance, and the waits that go with them."""

    def __init__(self) -> None:
        self._script: list[Behaviour] = []
        self._hold_after: int | None = None
        self._hold_midway = False
        self._firehose: tuple[int, int] | None = None
        self._paused_waiters: list[Deferred[None]] = []
        self._health_waiters: list[Deferred[None]] = []
        #: Bytes a firehose stream has written so far.
        self.firehose_written = 0
        self._release: Deferred[None] = Deferred()
        self._held: list[Deferred[None]] = []

    def script(self, *behaviours: Behaviour) -> None:
        """Answer the next requests so, one behaviour each, in order."""
        self._script.extend(behaviours)

    def refuse_next(self, status: int = 400, message: str = "bad request") -> None:
        """Answer the next request with a 4xx and vLLM's OpenAI error body."""
        self.script(ErrorAnswer(status=status, message=message))

    def crash_next(self, status: int = 500, message: str = "engine error") -> None:
        """Answer the next request with a 5xx, as a failing engine does."""
        self.script(ErrorAnswer(status=status, message=message))

    def omit_kv_transfer_params_next(self) -> None:
        """Answer the next prefill leg without ``kv_transfer_params``."""
        self.script(omit_kv_transfer_params())

    def spoil_kv_transfer_params_next(self, **changes: object) -> None:
        """Answer the next prefill leg with ``kv_transfer_params`` changed so: a key given
        None is left out (``remote_block_ids=[]``: no blocks; ``remote_port=None``: none)."""
        self.script(spoil_kv_transfer_params(**changes))

    def answer_next_with(
        self, status: int, body: bytes, content_type: bytes = b"application/json"
    ) -> None:
        """Answer the next request with exactly these bytes (garbage included)."""
        self.script(RawAnswer(status=status, body=body, content_type=content_type))

    def break_next(self, after_events: int = 1) -> None:
        """Cut the next answer off: a stream after ``after_events`` events, a
        JSON answer halfway through its announced ``Content-Length``."""
        self.script(break_off(after_events))

    def die_after_next(self, tokens: int) -> None:
        """Cut the next stream off after ``tokens`` generated tokens (its connection closed
        as by an instance that died); a test stops serving the fake to keep it dead."""
        self.script(die_after(tokens))

    def end_after_next(self, tokens: int) -> None:
        """End the next stream's body after ``tokens`` tokens as if whole, without its
        route's last event (``[DONE]``, ``message_stop``, ``response.completed``)."""
        self.script(end_after(tokens))

    def other_prompt_ids_next(self, die_after_tokens: int) -> None:
        """Answer the next stream with other prompt token ids than the request's (when
        asked for them), and cut it off after ``die_after_tokens`` tokens."""
        self.script(other_prompt_ids(die_after_tokens))

    def fail_after_next(self, tokens: int) -> None:
        """Answer vLLM's in-band error event in the next stream after ``tokens`` tokens."""
        self.script(fail_after(tokens))

    def hold_streams_after(self, chunks: int) -> None:
        """Let streams write ``chunks`` events, then wait for :meth:`release`."""
        self._hold_after = chunks

    def hold_answers(self) -> None:
        """Hold every answer, JSON or stream, before its first byte."""
        self._hold_after = 0
        self._hold_midway = False

    def hold_answers_midway(self) -> None:
        """Send JSON answers' headers and first half, then hold the rest."""
        self._hold_after = 0
        self._hold_midway = True

    def firehose(self, event_bytes: int = 64 * 1024, total_bytes: int = 64 * 1024 * 1024) -> None:
        """Make streams write big events as fast as the connection takes them.

        The fake writes only while its connection is not paused, so what it
        has written (``firehose_written``) shows whether backpressure reached
        it; ``firehose_paused()`` fires the first time it is paused.
        """
        self._firehose = (event_bytes, total_bytes)

    def firehose_paused(self) -> Deferred[None]:
        waiting: Deferred[None] = Deferred()
        self._paused_waiters.append(waiting)
        return waiting

    def next_health_check(self) -> Deferred[None]:
        """Fires when the next ``GET /health`` arrives."""
        waiting: Deferred[None] = Deferred()
        self._health_waiters.append(waiting)
        return waiting

    def stream_held(self) -> Deferred[None]:
        """Fires when a stream reaches the hold point."""
        waiting: Deferred[None] = Deferred()
        self._held.append(waiting)
        return waiting

    def release(self) -> None:
        """Let held streams (and streams that reach the hold point) go on."""
        self._hold_after = None
        release, self._release = self._release, Deferred()
        release.callback(None)

    def _next_behaviour(self) -> Behaviour:
        return self._script.pop(0) if self._script else Behaviour()

    def _health_checked(self) -> None:
        waiters, self._health_waiters = self._health_waiters, []
        for waiting in waiters:
            waiting.callback(None)

    def _paused(self) -> None:
        waiters, self._paused_waiters = self._paused_waiters, []
        for waiting in waiters:
            waiting.callback(None)

    async def _wait_at_hold(self) -> None:
        # Held from before it is said to be: whoever it tells may release it at once.
        released = self._release_signal()
        held, self._held = self._held, []
        for waiting in held:
            waiting.callback(None)
        await released

    def _release_signal(self) -> Deferred[None]:
        waiting: Deferred[None] = Deferred()
        self._release.addBoth(lambda _: waiting.callback(None) if not waiting.called else None)
        return waiting

    async def _pour(self, request: Request, event_bytes: int, total_bytes: int) -> None:
        request.setHeader(b"Content-Type", b"text/event-stream")
        pour = _Pour(self, request, event_bytes, total_bytes)
        request.registerProducer(pour, True)
        pour.resumeProducing()
        try:
            await pour.done
        except CancelledError:
            return  # (its reader closed the stream: nobody to end it for)
        finally:
            request.unregisterProducer()
        request.write(b"data: [DONE]\n\n")  # (as vLLM ends a stream)


@implementer(IPushProducer)
class _Pour:
    """Writes SSE events of ``event_bytes`` while the connection is not paused."""

    def __init__(self, fake: Controls, request: Request, event_bytes: int, total: int) -> None:
        self.fake = fake
        self.request = request
        self.event = b"data: " + b"x" * (event_bytes - 8) + b"\n\n"
        self.total = total
        self.paused = False
        self.done: Deferred[None] = Deferred()

    def resumeProducing(self) -> None:
        self.paused = False
        while not self.paused and self.fake.firehose_written < self.total:
            self.fake.firehose_written += len(self.event)
            self.request.write(self.event)
        if self.fake.firehose_written >= self.total and not self.done.called:
            self.done.callback(None)

    def pauseProducing(self) -> None:
        self.paused = True
        self.fake._paused()

    def stopProducing(self) -> None:
        self.paused = True
        if not self.done.called:
            self.done.errback(CancelledError("the client went away"))
