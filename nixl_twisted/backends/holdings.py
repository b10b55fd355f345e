"""What ``kv-aware`` asks of vLLM's KV events: how much of a prompt each instance holds.

``Holdings`` is answered by ``kv.events.KvEvents`` (a room above, handed in
by the root); ``Reach`` is its answer for one instance, confirmed by the
events and counting what ``kv-aware`` predicted when it routed there.
``NO_HOLDINGS`` stands in where no events are read: ``kv-aware`` then
routes as ``cache-aware`` (``fallback_no_events``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Reach:
    """How much of a prompt an instance holds: its leading tokens, in whole blocks."""

    #: By vLLM's events.
    confirmed: int
    #: Counting the blocks predicted for it too (never less than ``confirmed``).
    expected: int
    #: The key of the last block of ``expected``: where the prefix it holds ends.
    last: int = field(default=0, compare=False)


class Holdings(Protocol):
    """What the KV events say each instance of a pool holds (``kv.events``)."""

    def reach(
        self, role: str, tokens: Sequence[int], urls: Collection[str], salt: str | None = None
    ) -> Mapping[str, Reach]:
        """Per instance, the leading tokens of ``tokens`` (under ``cache_salt`` ``salt``) it
        holds (in whole blocks)."""

    def predict(
        self, role: str, url: str, tokens: Sequence[int], salt: str | None = None
    ) -> Callable[[], object]:
        """``url`` was chosen for ``tokens``: its blocks predicted; returns what withdraws them."""

    def listening(self, role: str, url: str) -> bool:
        """Whether the instance's events are read at all."""

    def stale(self, role: str, url: str) -> bool:
        """Whether its entries may be wrong now (a gap being replayed, or cleared after one)."""

    def blocks(self, role: str, url: str) -> int:
        """The blocks it holds and was predicted: how much of what the pool caches is there."""


class _NoHoldings:
    """No KV events read: ``kv-aware`` falls back to ``cache-aware`` (``fallback_no_events``)."""

    def reach(
        self, role: str, tokens: Sequence[int], urls: Collection[str], salt: str | None = None
    ) -> Mapping[str, Reach]:
        return {}

    def predict(
        self, role: str, url: str, tokens: Sequence[int], salt: str | None = None
    ) -> Callable[[], object]:
        return _nothing

    def listening(self, role: str, url: str) -> bool:
        return False

    def stale(self, role: str, url: str) -> bool:
        return False

    def blocks(self, role: str, url: str) -> int:
        return 0


def _nothing() -> None:
    """Nothing was predicted: nothing to withdraw."""


NO_HOLDINGS: Holdings = _NoHoldings()
