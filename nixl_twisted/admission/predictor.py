"""``Rates``: how fast a model's decode slots free and how long its legs take, measured;
``predict``: a waiting request's first token, from its place in the queue and those rates.

Pure (a clock, no I/O). Fed by the legs as each completion's decode leg
ends (``Rates.ended``: its decode slot freed, its prefill's seconds and its
decode's first byte after the handoff, from its access record). Alone, the
drain rate is this process's decode releases of the model; shared through
``--replicas-redis``, the fleet's grants (``PlaceReply.grants``: every
model's, the fleet's one list), since each replica sees only its own
releases. While too little is measured (``MEASURED``) there is no
prediction, and so nothing is refused for its target.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from twisted.internet.interfaces import IReactorTime

#: Decode releases kept per model, to say how fast its slots free.
WINDOW = 64
#: Releases (or the fleet's grants) needed before a drain rate is said at all.
MEASURED = 8
#: Seconds after which a release no longer counts (a rate from an hour ago says nothing).
HORIZON = 60.0
#: The weight of each new leg time in its moving average.
ALPHA = 0.2


class Legged(Protocol):
    """What a completion's access record says of its legs (``observe.access.AccessRecord``)."""

    @property
    def prefill_seconds(self) -> float | None: ...

    @property
    def decode_first_byte_seconds(self) -> float | None: ...

    @property
    def ttft_predicted_base_seconds(self) -> float | None: ...

    @property
    def time_to_first_byte_seconds(self) -> float | None: ...

    @property
    def ttft_target(self) -> Any: ...

    @property
    def prompt_estimate(self) -> int | None: ...


@dataclass
class _Measured:
    """One model's measurements."""

    freed: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    prefill: float | None = None
    #: Prefill's seconds per prompt token (estimated from the body), a moving average.
    per_token: float | None = None
    first_byte: float | None = None
    #: Recent first tokens over what the model predicted them (before calibration), by
    #: the class of their target (``urgency``): the earliest deadlines go first, so an
    #: urgent request's error is not a patient one's.
    ratios: dict[int, deque[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Prediction:
    """A request's predicted first token (``seconds`` after it enters the queue), and the
    two waits it is made of: the queue ahead's (``fleet``, ``k / mu_d``) and its own tenant's
    backlog at its share (``own``, ``k_t / phi_t / mu_d``)."""

    seconds: float
    fleet: float
    own: float
    #: Prefill's and the first byte's seconds, as measured (its latest start needs them).
    legs: float
    #: ``seconds`` before calibration (``Rates.calibration``): what the error is read of.
    base: float = 0.0

    @property
    def tenant_bound(self) -> bool:
        """Its own tenant's backlog is why it waits (it is past its share)."""
        return self.own > self.fleet


def predict(
    ahead: int,
    own: int,
    share: float,
    drain_rate: float,
    prefill: float,
    first_byte: float,
) -> Prediction:
    """The first token of a request with ``ahead`` requests ahead of it (``own`` of them its
    tenant's, whose weight is ``share`` of the waiting tenants'), decode slots freeing at
    ``drain_rate`` per second: it waits ``max(k, k_t / phi_t) / mu_d`` for a slot, its
    prefill overlapping that wait, then its first byte: ``max(wait, T_p) + T_first``."""
    fleet = ahead / drain_rate
    mine = own / share / drain_rate if share > 0 else 0.0
    wait = max(fleet, mine)
    seconds = max(wait, prefill) + first_byte
    return Prediction(seconds, fleet, mine, prefill + first_byte, seconds)


#: Predictions measured against their first tokens before they are calibrated, and the
#: share of first tokens the calibrated prediction should cover.
CALIBRATED = 16
QUANTILE = 0.9
#: The least and most a prediction is multiplied by.
SCALE = (0.5, 4.0)


def urgency(target_ms: int) -> int:
    """A target's class for calibration: its power of two in ms (0: none)."""
    return max(0, int(target_ms)).bit_length()


#: Told a model's rates as they change: (model, drain rate, prefill seconds, first byte).
RatesSaid = Callable[[str | None, float | None, float | None, float | None], object]


class Rates:
    """Each model's measured decode drain rate, prefill seconds and first byte."""

    def __init__(self, clock: IReactorTime, said: RatesSaid | None = None) -> None:
        """``said``: told each model's rates when a leg ends (the gauges)."""
        self.clock = clock
        self.said = said
        self._models: dict[str | None, _Measured] = {}
        #: The fleet's grants (s, newest first) as ``PLACE`` said last (None: alone).
        self._fleet: list[float] | None = None

    def ended(self, model: str | None, record: Legged, prefilled: bool) -> None:
        """A completion's decode leg ended (its slot freed): its legs' times counted
        (``prefilled``: it took a prefill leg)."""
        measured = self._models.setdefault(model, _Measured())
        measured.freed.append(self.clock.seconds())
        if prefilled and record.prefill_seconds is not None:
            measured.prefill = _averaged(measured.prefill, record.prefill_seconds)
            tokens = record.prompt_estimate
            if tokens:
                measured.per_token = _averaged(measured.per_token, record.prefill_seconds / tokens)
        if record.decode_first_byte_seconds is not None:
            measured.first_byte = _averaged(measured.first_byte, record.decode_first_byte_seconds)
        base, actual = record.ttft_predicted_base_seconds, record.time_to_first_byte_seconds
        target = record.ttft_target
        if base and actual is not None and target is not None:
            ratios = measured.ratios.setdefault(urgency(target.ms), deque(maxlen=WINDOW))
            ratios.append(actual / base)
        if self.said is not None:
            self.said(model, self.drain_rate(model), measured.prefill, measured.first_byte)

    def fleet(self, grants_ms: list[float] | None) -> None:
        """The fleet's grants (ms, newest first) as ``PLACE`` said last; None: alone again."""
        self._fleet = None if grants_ms is None else [g / 1000 for g in grants_ms]

    def drain_rate(self, model: str | None) -> float | None:
        """Decode slots freed per second (None: not measured enough yet): the fleet's grants
        when shared, else this process's releases of ``model`` within ``HORIZON``."""
        if self._fleet is not None:
            return _rate(self._fleet[-1::-1], None)
        measured = self._models.get(model)
        if measured is None:
            return None
        return _rate(list(measured.freed), self.clock.seconds() - HORIZON)

    def prefill_seconds(self, model: str | None) -> float | None:
        measured = self._models.get(model)
        return None if measured is None else measured.prefill

    def first_byte_seconds(self, model: str | None) -> float | None:
        measured = self._models.get(model)
        return None if measured is None else measured.first_byte

    def predict(
        self,
        model: str | None,
        ahead: int,
        own: int,
        share: float,
        target_ms: int = 0,
        prompt: int | None = None,
    ) -> Prediction | None:
        """``predict`` for ``model`` with its measured rates (None: cold, nothing measured:
        no drain rate, or no first byte); its prefill from its ``prompt``'s tokens when
        known and measured (a long prompt's prefill is not the mean's), else the mean."""
        rate, first_byte = self.drain_rate(model), self.first_byte_seconds(model)
        if rate is None or first_byte is None:
            return None
        measured = self._models.get(model)
        per_token = None if measured is None else measured.per_token
        if prompt and per_token is not None:
            prefill = per_token * prompt
        else:
            prefill = self.prefill_seconds(model) or 0.0
        made = predict(ahead, own, share, rate, prefill, first_byte)
        return replace(made, seconds=made.seconds * self.calibration(model, target_ms))

    def calibration(self, model: str | None, target_ms: int = 0) -> float:
        """What ``model``'s predictions for a target of ``target_ms`` are multiplied by: the
        ``QUANTILE`` of its recent first tokens of targets of that class over their
        predictions (1 until ``CALIBRATED`` are measured; within ``SCALE``). The model above
        leaves out what it cannot see (requests that arrive after and go before, by their
        tenant's share; decode's own scheduling): measured so, the error is what the
        refusals allow for, on any workload."""
        measured = self._models.get(model)
        ratios = None if measured is None else measured.ratios.get(urgency(target_ms))
        if ratios is None or len(ratios) < CALIBRATED:
            return 1.0
        ordered = sorted(ratios)
        at = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
        return min(SCALE[1], max(SCALE[0], at))

    def models(self) -> list[str | None]:
        return list(self._models)


def _rate(times: list[float], since: float | None) -> float | None:
    """Events per second over ``times`` (oldest first) after ``since`` (None: all)."""
    kept = times if since is None else [t for t in times if t >= since]
    if len(kept) < MEASURED:
        return None
    span = kept[-1] - kept[0]
    if span <= 0:
        return None
    return (len(kept) - 1) / span


def _averaged(before: float | None, seen: float) -> float:
    return seen if before is None else before + ALPHA * (seen - before)
