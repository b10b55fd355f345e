"""The Responses API's follow-ups: which decode instance holds each response.

A response (``resp_...``) is stored by the decode instance that produced
it, so ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
must go there. The proxy reads the id from the first bytes of decode's
answer (the JSON answer, or the stream's ``response.created`` event) and
remembers the instance for the last ``limit`` responses. An id it does not
know (older than that, from before a restart, or seen by another worker or
replica) is asked of each decode instance in turn until one knows it.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable

#: How far into decode's answer the id is looked for.
_LOOK = 4096
_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')


class ResponseDirectory:
    """The decode instance of each of the last ``limit`` responses (bounded, LRU)."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._where: OrderedDict[str, str] = OrderedDict()

    def where(self, response_id: str) -> str | None:
        return self._where.get(response_id)

    def remember(self, response_id: str, instance_url: str) -> None:
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
