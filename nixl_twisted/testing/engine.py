"""The time a fake vLLM's engine takes: a prompt computed, KV pulled, tokens apart, streams stalled.

``FakeVLLM`` inherits these waits; they are apart so that its serving reads
on its own. Every wait is on the fake's ``clock``, so that a test drives
them with a ``twisted.internet.task.Clock``. Each cost is 0 (no wait, no
stall) unless the fake is given one.
"""

from __future__ import annotations

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater


class EngineTime:
    """Mixed into ``FakeVLLM``, whose fields these read."""

    clock: IReactorTime | None
    token_interval: float
    prefill_cost_per_token: float
    computing_stalls_streams: bool
    kv_load_cost_per_token: float
    kv_load_latency: float

    def __init__(self) -> None:
        #: When the computes under way on this instance end, in ``clock`` seconds.
        self._computing_until = 0.0

    def _time(self) -> IReactorTime:
        if self.clock is None:
            raise RuntimeError("this fake has no clock: give it one (clock=...) or listen() first")
        return self.clock

    async def _compute(self, uncached_tokens: int) -> None:
        """Compute a prompt's tokens not found in the prefix cache (a prefill or plain request)."""
        seconds = self.prefill_cost_per_token * uncached_tokens
        if seconds <= 0:
            return
        clock = self._time()
        if self.computing_stalls_streams:
            # The same sum as the timer's own deadline, so a stream that waits
            # for it wakes on the same tick as the compute ends.
            self._computing_until = max(self._computing_until, clock.seconds() + seconds)
        await deferLater(clock, seconds)

    async def _pull_kv(self, prompt_tokens: int) -> None:
        """A decode leg pulls the prompt's KV from the prefill before its first token."""
        seconds = self.kv_load_latency + self.kv_load_cost_per_token * prompt_tokens
        if seconds > 0:
            await deferLater(self._time(), seconds)

    async def _before_next_token(self) -> None:
        """A stream's wait before each event after its first: the token interval, then
        (``computing_stalls_streams``) until no compute is under way on this instance."""
        if self.token_interval > 0:
            await deferLater(self._time(), self.token_interval)
        if not self.computing_stalls_streams:
            return
        clock = self._time()
        until = self._computing_until
        # A compute that starts during the wait moves the end further: wait again.
        while until > clock.seconds():
            await deferLater(clock, until - clock.seconds())
            if self._computing_until == until:
                return
            until = self._computing_until
