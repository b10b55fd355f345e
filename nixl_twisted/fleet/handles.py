"""``FleetHandles``: decode's handles kept for every replica, each read by one (``reuse.kept``).

A handle another replica kept is found here, and claimed here atomically
(``handle_scripts``): a conversation whose turns reach different replicas
still reads its KV back, and never twice. A call Redis does not answer
within the replicas' budget fails with ``Unshared``; the store then keeps
and finds this replica's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.defer import Deferred

from nixl_twisted.fleet import handle_scripts
from nixl_twisted.fleet.replicas import Replicas
from nixl_twisted.reuse.handles import Handle, from_json
from nixl_twisted.reuse.kept import Looked


class FleetHandles:
    """The handles in ``--replicas-redis``."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    @property
    def available(self) -> bool:
        return self.replicas.is_shared

    def keep(
        self, key: bytes, handle: Handle, seconds: float, turn: tuple[bytes, str] | None
    ) -> Deferred[None]:
        ms = max(1, int(seconds * 1000))
        kept = handle_scripts.keep(self.replicas, key, handle.to_json(), ms, turn)
        return kept.addCallback(lambda _: None)

    def find(self, keys: Sequence[bytes]) -> Deferred[Looked]:
        def read(found: tuple[int, list[bytes]] | None) -> Looked:
            if found is None or not 0 <= found[0] <= len(keys):
                return Looked()
            place, held = found
            if place == 0:
                return Looked(turn=held[0].decode("utf-8", "replace"))
            handles = (from_json(each) for each in held)
            return Looked(keys[place - 1], tuple(h for h in handles if h is not None))

        return handle_scripts.find(self.replicas, keys).addCallback(read)

    def claim(self, key: bytes, handle: Handle) -> Deferred[bool]:
        return handle_scripts.claim(self.replicas, key, handle.stamp)
