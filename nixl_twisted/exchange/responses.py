"""The Responses API's follow-ups: which decode instance holds each response, and whose it is.

A response (``resp_...``) is stored by the decode instance that produced
it, so ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
must go there. The proxy reads the id from the first bytes of decode's
answer (the JSON answer, or the stream's ``response.created`` event) and
remembers the instance, and the tenant that asked (its owner), for the
last ``limit`` responses and each owner's last ``per_owner``. With
``--replicas-redis`` it also tells Redis (``fleet.responses``), where every
replica and worker finds it for an hour: an id this process does not know
is looked up there (within the replicas' budget of 100 ms).

Only its owner reaches a stored response: another tenant is answered 404,
as OpenAI answers an id it does not know. With tenants (a request with
one), an id whose owner nobody knows is refused the same way; without, it
is asked of each decode instance in turn until one knows it (older than
the hour, from before a restart without ``--replicas-redis``, or Redis away).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from twisted.internet.defer import Deferred, maybeDeferred

from nixl_twisted.fleet.responses import UNKNOWN_OWNER, Stored
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

#: How far into decode's answer the id is looked for.
_LOOK = 4096
_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')


class SharedDirectory(Protocol):
    """Where every replica keeps the instance of each stored response (``fleet.responses``)."""

    def stored(self, response_id: str, where: Stored) -> None:
        """Kept for every replica; never waited for."""

    def find(self, response_id: str) -> Deferred[Stored | None]:
        """What another replica kept, or None (not kept, or Redis away)."""


class ResponseDirectory:
    """The decode instance and owner of each of the last ``limit`` responses, and of each
    owner's last ``per_owner`` (bounded, LRU), and with ``shared`` every replica's."""

    def __init__(
        self, limit: int = 10_000, shared: SharedDirectory | None = None, per_owner: int = 1000
    ) -> None:
        self.limit = limit
        self.per_owner = per_owner
        self.shared = shared
        self._where: OrderedDict[str, Stored] = OrderedDict()
        #: Each owner's ids, oldest first.
        self._owned: dict[str | None, OrderedDict[str, None]] = {}

    def where(self, response_id: str) -> Stored | None:
        return self._where.get(response_id)

    def find(self, response_id: str, tenant: str | None) -> Deferred[str | None]:
        """Its instance, for ``tenant`` (None: no tenant): as this process knows it, else as
        the replicas keep it; None: nobody knows (ask each instance). A 404 (``ProxyError``)
        when it is another tenant's, or, with a tenant, whose it is is not known."""
        here = self.where(response_id)
        if here is not None or self.shared is None:
            return maybeDeferred(_theirs, response_id, here, tenant)

        def found(there: Stored | None) -> str | None:
            if there is not None and there.owner != UNKNOWN_OWNER:
                self._keep(response_id, there)
            return _theirs(response_id, there, tenant)

        return self.shared.find(response_id).addCallback(found)

    def remember(self, response_id: str, instance_url: str, owner: str | None = None) -> None:
        where = Stored(instance_url, owner)
        self._keep(response_id, where)
        if self.shared is not None:
            self.shared.stored(response_id, where)

    def _keep(self, response_id: str, where: Stored) -> None:
        self._forget(response_id)
        self._where[response_id] = where
        owned = self._owned.setdefault(where.owner, OrderedDict())
        owned[response_id] = None
        if len(owned) > self.per_owner:
            self._forget(next(iter(owned)))
        while len(self._where) > self.limit:
            self._forget(next(iter(self._where)))

    def _forget(self, response_id: str) -> None:
        gone = self._where.pop(response_id, None)
        if gone is None:
            return
        owned = self._owned[gone.owner]
        del owned[response_id]
        if not owned:
            del self._owned[gone.owner]

    def watcher(self, instance_url: str, owner: str | None = None) -> Callable[[bytes], bool]:
        """A relay watch that remembers the response id it sees pass, as ``owner``'s."""
        seen = bytearray()

        def watch(chunk: bytes) -> bool:
            seen.extend(chunk[: _LOOK - len(seen)])
            found = _ID.search(seen)
            if found is not None:
                self.remember(found.group(1).decode("ascii"), instance_url, owner)
                return True
            return len(seen) >= _LOOK  # not there: stop looking

        return watch


def _theirs(response_id: str, stored: Stored | None, tenant: str | None) -> str | None:
    """The instance of ``stored`` if it is ``tenant``'s; None: unknown, to be asked of each
    instance (without tenants only)."""
    if stored is None and tenant is None:
        return None
    # (without a tenant, one a replica did not say is none)
    owners = (tenant,) if tenant is not None else (None, UNKNOWN_OWNER)
    if stored is not None and stored.owner in owners:
        return stored.instance_url
    why = "whose it is is not known" if stored is None else "it is another tenant's"
    raise ProxyError(
        ErrorCode.NOT_FOUND,
        f"Response with id '{response_id}' not found.",
        detail=f"response {response_id} not found for tenant {tenant!r}: {why}",
    )
