"""``SharedResponses``: which decode instance holds each stored response, and whose it is,
kept for every replica.

The Responses API stores a response on the decode instance that made it;
``GET /v1/responses/{id}`` and its cancel must go there, whichever replica
the client reaches, for its owner alone. Each id seen is kept in Redis
(``route_scripts``: ``response:ID``, an hour, each tenant's latest
``--responses-per-tenant``, sent with the turn's routing choices by the
``outbox``, never waited for); a replica that does not know an id looks it
up there within the replicas' budget, and when Redis does not answer asks
each decode instance in turn, as a lone proxy does
(``exchange.responses``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from nixl_twisted.fleet import route_scripts
from nixl_twisted.fleet.outbox import Outbox
from nixl_twisted.fleet.replicas import Replicas, Unshared
from nixl_twisted.fleet.replies import text

#: The owner of a response kept by a replica that did not say whose it was.
UNKNOWN_OWNER = "\n"


class Stored(NamedTuple):
    """Where a stored response is, and whose it is (its tenant; None: none)."""

    instance_url: str
    owner: str | None


class SharedResponses:
    """The instance of each stored response, in ``--replicas-redis``."""

    def __init__(self, replicas: Replicas, outbox: Outbox) -> None:
        self.replicas = replicas
        self.outbox = outbox

    def stored(self, response_id: str, where: Stored) -> None:
        self.outbox.stored(response_id, where.instance_url, where.owner)

    def find(self, response_id: str) -> Deferred[Stored | None]:
        asked = route_scripts.response(self.replicas, response_id)

        def said(value: Any) -> Stored | None:
            if value is None:
                return None
            instance_url, kept, owner = text(value).partition("\n")
            if not kept:  # (kept by a replica that did not say whose it is)
                return Stored(instance_url, UNKNOWN_OWNER)
            return Stored(instance_url, owner or None)

        def away(failure: Failure) -> None:
            failure.trap(Unshared)
            return None

        return asked.addCallbacks(said, away)
