"""``SharedResponses``: which decode instance holds each stored response, kept for every replica.

The Responses API stores a response on the decode instance that made it;
``GET /v1/responses/{id}`` and its cancel must go there, whichever replica
the client reaches. Each id seen is kept in Redis (``route_scripts``:
``response:ID``, an hour, sent with the turn's routing choices by the
``outbox``, never waited for); a replica that does not know an id looks it
up there within the replicas' budget, and when Redis does not answer asks
each decode instance in turn, as a lone proxy does
(``exchange.responses``).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from nixl_twisted.fleet import route_scripts
from nixl_twisted.fleet.outbox import Outbox
from nixl_twisted.fleet.replicas import Replicas, Unshared
from nixl_twisted.fleet.replies import text


class SharedResponses:
    """The instance of each stored response, in ``--replicas-redis``."""

    def __init__(self, replicas: Replicas, outbox: Outbox) -> None:
        self.replicas = replicas
        self.outbox = outbox

    def stored(self, response_id: str, instance_url: str) -> None:
        self.outbox.stored(response_id, instance_url)

    def find(self, response_id: str) -> Deferred[str | None]:
        asked = self.replicas.call(route_scripts.RESPONSE, [response_id], "response")

        def said(value: Any) -> str | None:
            if value is None:
                return None
            return text(value)

        def away(failure: Failure) -> None:
            failure.trap(Unshared)
            return None

        return asked.addCallbacks(said, away)
