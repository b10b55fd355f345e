"""Blocks an instance was just sent and will hold soon: kv-aware's choices, kept until vLLM speaks.

vLLM reports a block only once its engine step has run: a prompt routed
before the previous one's blocks are reported would see nothing, and two
requests sharing a new prefix that arrive together would go to two
instances. So when ``kv-aware`` sends a prompt to an instance, the blocks
it will fill are recorded for that instance at once, *predicted*, for
``PREDICTED_LIFE`` seconds (as vllm-project/router's speculative entries,
llm-d's ``speculativeIndexing`` and Dynamo's predicted blocks do).

vLLM's events settle each of them: a ``BlockStored`` of the block confirms
it (the confirmed entry speaks from then on), a ``BlockRemoved`` of it or an
``AllBlocksCleared`` drops it, and so does a leg that failed
(``withdraw``); the rest expire. Each outcome is counted per instance, so
an operator can tell predictions that came true from those that did not.
The life is counted on the clock given, and expiry is lazy: what is past
its life is swept when the index is next asked.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from twisted.internet.interfaces import IReactorTime

#: Seconds a predicted block counts before vLLM's events must have confirmed it: a
#: prefill waiting in vLLM's queue is scheduled, and its step's events arrive, well
#: within it; a prediction nobody confirms (an instance whose blocks the index
#: cannot see) steers a prompt's followers for no longer.
PREDICTED_LIFE = 10.0
#: What becomes of predicted blocks, as counted.
OUTCOMES = ("confirmed", "expired", "removed", "cleared", "failed")


@dataclass(frozen=True)
class Prediction:
    """One choice's predicted blocks on one instance: what ``withdraw`` takes back."""

    url: str
    keys: tuple[int, ...]
    #: When they expire: a later choice of the same blocks re-dates them, and then
    #: this one no longer speaks for them.
    expires: float


#: A choice that predicted nothing.
NOTHING = Prediction("", (), 0.0)


class Predictions:
    """For one pool: per instance, the block keys predicted for it and until when."""

    def __init__(self, clock: IReactorTime, max_blocks: int, life: float = PREDICTED_LIFE) -> None:
        self.clock = clock
        #: The most blocks predicted per instance (as confirmed ones, ``--kv-index-blocks``).
        self.max_blocks = max_blocks
        self.life = life
        #: Per instance, key -> expiry, the first to expire first (the life is one).
        self._by_url: dict[str, OrderedDict[int, float]] = {}
        #: Per key, the instances it is predicted for -> expiry.
        self._by_key: dict[int, dict[str, float]] = {}
        #: Per instance, how many predicted blocks came to each of ``OUTCOMES``.
        self.outcomes: dict[str, Counter[str]] = {}

    def predict(self, url: str, keys: Iterable[int], expires: float | None = None) -> Prediction:
        """``url`` will hold these blocks: each counts as held until settled or ``expires``
        (by default, ``life`` from now)."""
        self.sweep()
        if expires is None:
            expires = self.clock.seconds() + self.life
        held = self._by_url.setdefault(url, OrderedDict())
        predicted = []
        for key in keys:
            held[key] = expires
            held.move_to_end(key)
            self._by_key.setdefault(key, {})[url] = expires
            predicted.append(key)
        while len(held) > self.max_blocks:
            self._drop(url, next(iter(held)), "expired")
        return Prediction(url, tuple(predicted), expires) if predicted else NOTHING

    def withdraw(self, prediction: Prediction, outcome: str | None = "failed") -> None:
        """The leg failed: its blocks are dropped, unless a later choice predicted them again.

        ``outcome`` None: dropped uncounted (keyed again by another block size).
        """
        held: Mapping[int, float] = self._by_url.get(prediction.url) or {}
        for key in prediction.keys:
            if held.get(key) == prediction.expires:
                self._drop(prediction.url, key, outcome)

    def settled(self, url: str, key: int, outcome: str) -> None:
        """vLLM's events said what became of a block of ``url``: ``confirmed`` or ``removed``."""
        held = self._by_url.get(url)
        if held is not None and key in held:
            self._drop(url, key, outcome)

    def clear(self, url: str) -> None:
        """Every prediction of ``url`` dropped: its cache was cleared, or it left."""
        held = self._by_url.pop(url, None)
        for key in held or ():
            self._unlink(url, key)
        if held:
            self.outcomes.setdefault(url, Counter())["cleared"] += len(held)

    def live(self, url: str, key: int) -> bool:
        """Whether ``key`` is predicted for ``url`` now."""
        expires = self._by_key.get(key, {}).get(url)
        return expires is not None and expires > self.clock.seconds()

    def count(self, url: str) -> int:
        """Blocks predicted for ``url`` and not yet settled or expired."""
        self.sweep()
        return len(self._by_url.get(url, ()))

    def sweep(self) -> None:
        """Predictions past their life are dropped (the first to expire is first in line)."""
        now = self.clock.seconds()
        for url, held in list(self._by_url.items()):
            while held:
                key, expires = next(iter(held.items()))
                if expires > now:
                    break
                self._drop(url, key, "expired")

    def _drop(self, url: str, key: int, outcome: str | None) -> None:
        held = self._by_url[url]
        del held[key]
        if not held:
            del self._by_url[url]
        self._unlink(url, key)
        if outcome is not None:
            self.outcomes.setdefault(url, Counter())[outcome] += 1

    def _unlink(self, url: str, key: int) -> None:
        by_key = self._by_key.get(key)
        if by_key is not None:
            by_key.pop(url, None)
            if not by_key:
                del self._by_key[key]
