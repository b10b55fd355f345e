"""The Responses API's follow-ups: which decode instance holds each response.

A response (``resp_...``) is stored by the decode instance that produced
it, so ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
must go there. The proxy reads the id from the first bytes of decode's
answer (the JSON answer, or the stream's ``response.created`` event) and
remembers the instance for the last ``limit`` responses. With
``--replicas-redis`` it also tells Redis (``fleet.responses``), where every
replica and worker finds it for an hour: an id this process does not know
is looked up there (within the replicas' budget of 100 ms). An id nobody
knows (older than that, from before a restart without ``--replicas-redis``,
or Redis away) is asked of each decode instance in turn until one knows it.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from twisted.internet.defer import Deferred, succeed

#: How far into decode's answer the id is looked for.
_LOOK = 4096
_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')


class SharedDirectory(Protocol):
    """Where every replica keeps the instance of each stored response (``fleet.responses``)."""

    def stored(self, response_id: str, instance_url: str) -> None:
        """Kept for every replica; never waited for."""

    def find(self, response_id: str) -> Deferred[str | None]:
        """The instance another replica kept, or None (not kept, or Redis away)."""


class ResponseDirectory:
    """The decode instance of each of the last ``limit`` responses (bounded, LRU), and with
    ``shared`` every replica's."""

    def __init__(self, limit: int = 10_000, shared: SharedDirectory | None = None) -> None:
        self.limit = limit
        self.shared = shared
        self._where: OrderedDict[str, str] = OrderedDict()

    def where(self, response_id: str) -> str | None:
        return self._where.get(response_id)

    def find(self, response_id: str) -> Deferred[str | None]:
        """Its instance as this process knows it, else as the replicas keep it."""
        here = self.where(response_id)
        if here is not None or self.shared is None:
            return succeed(here)

        def found(there: str | None) -> str | None:
            if there is not None:
                self._keep(response_id, there)
            return there

        return self.shared.find(response_id).addCallback(found)

    def remember(self, response_id: str, instance_url: str) -> None:
        self._keep(response_id, instance_url)
        if self.shared is not None:
            self.shared.stored(response_id, instance_url)

    def _keep(self, response_id: str, instance_url: str) -> None:
        self._where[response_id] = instance_url
        self._where.move_to_end(response_id)
        while len(self._where) > self.limit:
            self._where.popitem(last=False)

    def watcher(self, instance_url: str) -> Callable[[bytes], bool]:
        """A relay watch that remembers the response id it sees pass."""
        seen = bytearray()

        def watch(chunk: bytes) -> bool:
            seen.extend(chunk[: _LOOK - len(seen)])
            found = _ID.search(seen)
            if found is not None:
                self.remember(found.group(1).decode("ascii"), instance_url)
                return True
            return len(seen) >= _LOOK  # not there: stop looking

        return watch
