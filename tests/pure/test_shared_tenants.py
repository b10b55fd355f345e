"""A tenant's place in ``--replicas-redis`` when its client leaves while Redis is asked."""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import CancelledError, Deferred

from nixl_twisted.admission.shared_tenants import SharedTenants
from nixl_twisted.fleet.replicas import Replicas


class Answered:
    """Replicas whose Redis answers when the test says (each call kept, in order)."""

    is_shared = True
    count = 1

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Any], Deferred[Any]]] = []

    def hold(self, holder: object) -> None:
        pass

    def call(
        self, script: str, args: list[Any], name: str, read: Any = lambda reply: reply
    ) -> Deferred[Any]:
        asked: Deferred[Any] = Deferred()
        self.calls.append((name, args, asked))
        return asked.addCallback(read)


def test_a_place_granted_after_its_client_left_is_given_back() -> None:
    replicas = Answered()
    tenants = SharedTenants(cast(Replicas, replicas))
    admitted = tenants.admit("a", 2)
    admitted.cancel()  # its client leaves while Redis is asked
    failures: list[Any] = []
    admitted.addErrback(failures.append)
    assert failures[0].check(CancelledError)

    (_, (tenant, _, place), asked), *_ = replicas.calls
    asked.callback([1])  # Redis granted it all the same

    assert [(name, args) for name, args, _ in replicas.calls[1:]] == [("tenant", [tenant, place])]
    assert tenants.places == {}


def test_a_place_granted_while_its_client_waits_is_its_own() -> None:
    replicas = Answered()
    tenants = SharedTenants(cast(Replicas, replicas))
    admitted = tenants.admit("a", 2)
    replicas.calls[0][2].callback([1])
    place = admitted.result
    assert tenants.places == {place: "a"} and len(replicas.calls) == 1
