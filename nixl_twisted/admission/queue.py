"""``SlotQueue``: where completions wait for their slots in the fair order.

Two stores, one interface: this process's queue (``fair_queue``) or every
replica's through ``--replicas-redis`` (``shared_queue``), chosen once at the
composition root. ``Slots`` never asks which it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred

from nixl_twisted.admission.predictor import Prediction
from nixl_twisted.admission.waiting import Claim, Pool
from nixl_twisted.protocol.errors import ProxyError

T = TypeVar("T")


class SlotQueue(Protocol[T]):
    """Requests waiting for ``place`` to find them slots, let go in the fair order."""

    size: int
    timeout: float

    def __len__(self) -> int: ...

    def waiting(self) -> list[Any]: ...

    def enter(self, ticket: Claim, place: Callable[[], T | Pool]) -> T | Deferred[T]: ...

    def pump(self) -> None: ...

    def shut(self, error: Callable[[], ProxyError]) -> None: ...

    def withdraw(self, deferred: Deferred[T]) -> bool:
        """The request waiting on ``deferred`` leaves, nothing fired (the lease guard sends
        it on); whether it waited."""

    def on_entered(self, entered: Callable[[], object]) -> None:
        """``entered()`` is called each time a request starts to wait."""

    def predict(self, ticket: Claim) -> Prediction | None:
        """A new request's first token, predicted (``predictor``; None: none)."""
