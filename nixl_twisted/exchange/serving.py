"""``Serving``: the one object that serves every admitted request, and holds those in flight.

A completion is one ``Exchange`` (two legs), or a batch of them (one per
prompt, ``batch``); a one-leg route is relayed to a decode instance
(``one_leg``). What is the proxy's and not the request's (the pools, the
clock, the metrics, the configuration in effect) is ``Legs``, made once;
what varies per request is the value the door read (``protocol.completion``).
On a drain that timed out, ``shut_down`` cuts every completion still running.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.server import Request

from nixl_twisted.exchange import one_leg
from nixl_twisted.exchange.batch import Batch, PartRequest
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.request import ExchangeRequest
from nixl_twisted.exchange.responses import ResponseDirectory
from nixl_twisted.exchange.two_legs import Exchange
from nixl_twisted.observe.access import record_of
from nixl_twisted.observe.spans import RequestTrace
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.completion import Completion, Relayed


class Serving:
    """Serves each admitted request over its legs; owns the completions in flight."""

    def __init__(self, legs: Legs, responses: ResponseDirectory) -> None:
        self.legs = legs
        #: Which decode instance produced each Responses API response.
        self.responses = responses
        #: The completions being served now.
        self.exchanges: set[Exchange] = set()

    def completion(
        self, request: Request, completion: Completion, trace: RequestTrace
    ) -> Deferred[None]:
        """Two legs, or a batch's parts each with its own (all in the request's one trace;
        the batch sums its parts' usage chunks, and sends one only if asked)."""
        if completion.batch is None:
            return self._exchange(request, completion, trace)

        def part(to: PartRequest, one: Completion) -> Deferred[None]:
            record_of(to).served_model = record_of(request).served_model
            return self._exchange(to, one, trace, part=True)

        return Batch(request, completion, part).start()

    def relayed(self, request: Request, relayed: Relayed, trace: RequestTrace) -> Deferred[None]:
        """A one-leg route, to the next decode instance that serves its model."""
        return Deferred.fromCoroutine(one_leg.relay(self.legs, request, relayed, trace))

    def follow_up(
        self, request: Request, relayed: Relayed, response_id: str, trace: RequestTrace
    ) -> Deferred[None]:
        """A stored response's route, to the decode instance that holds it first."""

        async def follow() -> None:
            holder = await self.responses.find(response_id, record_of(request).tenant)
            await one_leg.follow_up(self.legs, request, relayed, holder, trace)

        return Deferred.fromCoroutine(follow())

    def _exchange(
        self,
        request: ExchangeRequest,
        completion: Completion,
        trace: RequestTrace,
        part: bool = False,
    ) -> Deferred[None]:
        watch = None
        if completion.path == routes.RESPONSES:  # (its id kept as its tenant's)
            watch = partial(self.responses.watcher, owner=record_of(request).tenant)
        exchange = Exchange(self.legs, request, completion, trace, watch, part)
        self.exchanges.add(exchange)

        def ended(result: object) -> object:
            self.exchanges.discard(exchange)
            return result

        return exchange.start().addBoth(ended)

    def stop_queueing(self) -> None:
        """The drain timeout ended: every completion still waiting for its slots is answered at
        once (503)."""
        if self.legs.slots is not None:
            self.legs.slots.shut()

    def queues(self) -> list[dict[str, Any]]:
        """What waits in the proxy's queue, by model (``Slots.status``)."""
        return self.legs.slots.status() if self.legs.slots is not None else []

    def shut_down(self) -> None:
        """The drain timeout ended: every completion still running is cut, and told why."""
        for exchange in list(self.exchanges):
            exchange.shut_down()
