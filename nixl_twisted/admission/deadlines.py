"""First-token deadlines in the queue: who is refused early, and who of a tenant goes first.

Pure. A request with a target (``Claim.target``) whose tenant does not
say ``ttft-miss = "serve"`` is refused at once when its predicted first
token (``predictor.predict``) passes its target by more than the
predictor's margin (``MISS_FACTOR``, ``MISS_SLACK``): 429
``ttft_unreachable_for_tenant`` when its own tenant's backlog is why, else
503 ``ttft_unreachable``; and again at its latest start (its arrival plus
its target, less the measured prefill and first byte) if it still waits
then. A "serve" request is never refused for its target.

Within one tenant's requests of one model and priority the earliest
deadline goes first (``most_urgent``): the queue's tags stay as fairness
between tenants gave them; when a tenant's tag comes up, its most urgent
request takes that place. A "serve" request past its deadline is ordered
as one with no target (demoted, never promoted: a late request pushed
ahead would make the next ones late too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

from nixl_twisted.admission.predictor import Prediction, Rates
from nixl_twisted.admission.waiting import Claim, Waiting
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

#: A predicted first token may pass its target by this factor, plus ``MISS_SLACK`` seconds,
#: before it is refused: none, since the prediction is calibrated by its measured error
#: (``Rates.calibration``).
MISS_FACTOR = 1.0
MISS_SLACK = 0.0

W = TypeVar("W", bound="Waiting[Any]")


def refuses(ticket: Claim) -> bool:
    """Whether ``ticket`` may be refused for its target: it has one, its tenant does not
    say it would rather be served late, and it is not prefilled already."""
    return ticket.target is not None and ticket.rule.ttft_miss != "serve" and not ticket.is_ready


def misses(prediction: Prediction, target_ms: int) -> bool:
    """Whether ``prediction`` passes the target, margin included."""
    return prediction.seconds > target_ms / 1000 * MISS_FACTOR + MISS_SLACK


def deadline(ticket: Claim, arrived: float) -> float:
    """When its first token is due (infinity: no target)."""
    return math.inf if ticket.target is None else arrived + ticket.target.ms / 1000


def latest_start(ticket: Claim, arrived: float, prediction: Prediction) -> float:
    """The time by which it must have its slots to make its target: its deadline less the
    measured prefill and first byte."""
    return deadline(ticket, arrived) - prediction.legs


def unreachable(prediction: Prediction, target_ms: int) -> ProxyError:
    """The refusal of a request predicted to miss its target: 429 when its own tenant's
    backlog is why (``Retry-After``: that backlog's drain), else 503 (the queue ahead's
    drain, 1 s at least)."""
    if prediction.tenant_bound:
        return ProxyError(
            ErrorCode.TTFT_UNREACHABLE_FOR_TENANT,
            f"its first token is predicted in {prediction.seconds:.1f} s, past its target "
            f"({target_ms} ms): its own tenant's requests waiting ahead of it take that long "
            "at the tenant's share: try again later",
            retry_after=max(1.0, prediction.own),
        )
    return ProxyError(
        ErrorCode.TTFT_UNREACHABLE,
        f"its first token is predicted in {prediction.seconds:.1f} s, past its target "
        f"({target_ms} ms), behind the requests waiting: try again later",
        retry_after=max(1.0, prediction.fleet),
    )


def urgency(waiting: Waiting[Any], now: float) -> float:
    """Its deadline as the order within its tenant reads it: infinity with no target, and
    for a "serve" request whose deadline passed (demoted)."""
    due = deadline(waiting.ticket, waiting.arrived)
    if due < now and waiting.ticket.rule.ttft_miss == "serve":
        return math.inf
    return due


def most_urgent(first: W, others: Iterable[W], now: float) -> W:
    """Of ``first`` (whose tag came up) and ``others`` (its tenant's others, same model and
    priority), the one that goes: the earliest deadline, then the earliest arrival."""
    best, due = first, (urgency(first, now), first.arrived, first.order)
    for other in others:
        other_due = (urgency(other, now), other.arrived, other.order)
        if other_due < due:
            best, due = other, other_due
    return best


#: A queue's entry: (priority, finish tag, order) and the request behind them.
Entry = tuple[int, float, int, W]


def swap_most_urgent(heap: list[Entry[W]], now: float) -> bool:
    """The request behind ``heap[0]``'s tag becomes its tenant's most urgent (same model and
    priority): the two swap their places behind the tags, which stay where they are (so the
    heap and fairness between tenants are as they were); whether they swapped."""
    head = heap[0]
    first = head[-1]
    tenant, priority = first.ticket.tenant, head[0]
    others = [
        (i, item[-1])
        for i, item in enumerate(heap)
        if i and item[0] == priority and item[-1].ticket.tenant == tenant and not item[-1].done
    ]
    best = most_urgent(first, (w for _, w in others), now)
    if best is first:
        return False
    at = next(i for i, w in others if w is best)
    heap[0], heap[at] = (*head[:3], best), (*heap[at][:3], first)
    first.finish, best.finish = best.finish, first.finish
    return True


def position(
    heap: list[Entry[W]],
    ticket: Claim,
    key: tuple[int, float, int],
    due: float,
    now: float,
    itself: W | None = None,
) -> tuple[int, int, float]:
    """Where a request of ``ticket`` with tag ``key`` and deadline ``due`` stands: the
    requests let go before it (``k``), how many of them are its tenant's (``k_t``: those
    more urgent, whose tags it lets go first) and its tenant's weight share among the
    tenants waiting at its priority (``phi_t``); ``itself``: its own entry, when it waits."""
    own_keys, urgent, weights = [key], 0, {ticket.tenant: ticket.weight}
    live = [item for item in heap if not item[-1].done and item[-1] is not itself]
    for item in live:
        waiting = item[-1]
        if item[0] != key[0]:
            continue
        weights[waiting.ticket.tenant] = waiting.ticket.weight
        if waiting.ticket.tenant == ticket.tenant:
            own_keys.append(item[:3])
            urgent += urgency(waiting, now) <= due
    tag = sorted(own_keys)[urgent]  # (the tag it goes at: its tenant's EDF takes the earliest)
    others = sum(1 for item in live if item[:3] < tag and item[-1].ticket.tenant != ticket.tenant)
    return others + urgent, urgent, ticket.weight / sum(weights.values())


def predicted(
    rates: Rates,
    heap: list[Entry[W]],
    ticket: Claim,
    key: tuple[int, float, int],
    arrived: float,
    now: float,
    itself: W | None = None,
    refusing: bool = False,
    committed: int = 0,
) -> Prediction | None:
    """The first token of ``ticket``'s request, from where it stands in ``heap`` (None: no
    target, or, ``refusing``, one it is never refused for; or nothing is measured yet);
    ``committed``: its model's requests past their prefill slot's wait (prefilling or
    ready), whose decode slots come before its own."""
    if ticket.target is None or (refusing and not refuses(ticket)):
        return None
    ahead, own, share = position(heap, ticket, key, deadline(ticket, arrived), now, itself)
    target_ms = ticket.target.ms
    return rates.predict(ticket.model, ahead + committed, own, share, target_ms, ticket.prompt)


def missed(prediction: Prediction, ticket: Claim) -> ProxyError | None:
    """The refusal of a request ``prediction`` says misses its target (None: it makes it)."""
    assert ticket.target is not None
    return (
        unreachable(prediction, ticket.target.ms) if misses(prediction, ticket.target.ms) else None
    )


def too_late(
    rates: Rates, heap: list[Entry[W]], waiting: W, now: float, committed: int = 0
) -> ProxyError:
    """The refusal of ``waiting``, still waiting at its latest start: as at its arrival, from
    where it stands now (503 with a 1 s ``Retry-After`` if nothing is measured any more)."""
    ticket = waiting.ticket
    assert ticket.target is not None
    key = next(item[:3] for item in heap if item[-1] is waiting)
    prediction = predicted(
        rates, heap, ticket, key, waiting.arrived, now, waiting, False, committed
    )
    if prediction is None:
        prediction = Prediction(math.inf, 0.0, 0.0, 0.0)
    return unreachable(prediction, ticket.target.ms)


# -- in every replica's queue (``shared_queue``): the fleet's count as what is ahead ------


def fleet_prediction(
    rates: Rates, ticket: Claim, waiting: int, refusing: bool = False
) -> Prediction | None:
    """The first token of ``ticket``'s request in the fleet's queue, which tells only how
    many wait in all (every model's and priority's): all taken as ahead of it, an upper
    bound, and its tenant's share unknown (so never a 429)."""
    if ticket.target is None or (refusing and not refuses(ticket)):
        return None
    return rates.predict(ticket.model, waiting, 0, 1.0, ticket.target.ms, ticket.prompt)


def fleet_refusal(rates: Rates, ticket: Claim, waiting: int) -> ProxyError | None:
    """The refusal of a new request in the fleet's queue predicted to miss its target (None:
    it may wait, or nothing waits and it goes at once if its slots are free)."""
    prediction = fleet_prediction(rates, ticket, waiting, refusing=True) if waiting else None
    return None if prediction is None else missed(prediction, ticket)


def fleet_too_late(rates: Rates, ticket: Claim, waiting: int) -> ProxyError:
    """The refusal of a request still waiting in the fleet's queue at its latest start."""
    assert ticket.target is not None
    prediction = fleet_prediction(rates, ticket, waiting)
    if prediction is None:
        prediction = Prediction(math.inf, 0.0, 0.0, 0.0)
    return unreachable(prediction, ticket.target.ms)
