"""One leg over a pool: choose an instance, hold it, send, and try another when it failed.

``send_leg`` serves every leg: prefill, decode, the single-leg routes, the
Responses API's follow-ups. An ``Order`` chooses each attempt's instance
(``ByPolicy``: the pool's policy); an attempt raises ``Retry`` when the
instance, not the request, failed (nothing usable was answered): the
instance is accounted for, its lease released, and the next instance
tried, up to the order's retries (``Elsewhere``: it answered, but what the
leg wants is on another). Any other outcome ends the leg. Whose the leg is
(its trace, its access record, whether it is still wanted) is ``Asked``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import CancelledError
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed, ResponseNeverReceived
from twisted.web.iweb import IResponse

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool, Lease, NoHealthyInstance, NoRoom
from nixl_twisted.backends.routing import NO_ROUTING, Routing
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import NO_ATTEMPT, NO_TRACE, AttemptTrace, RequestTrace
from nixl_twisted.protocol import codes
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

T = TypeVar("T")

#: How a connection is lost once the request was written to it (the instance may have it).
_SENT = (ResponseNeverReceived, ResponseFailed)


class Retry(Exception):
    """The instance failed (``down`` says why): another may serve the same leg.

    ``down`` None: it did not fail, it is full (vLLM answered 503: its engine's
    queue is full); it counts as full for a moment, not toward marking it down.
    """

    def __init__(
        self, error: ProxyError, outcome: str, down: str | None, sent: bool = False
    ) -> None:
        super().__init__(error.detail)
        #: What the client sees if no other instance serves the leg.
        self.error = error
        self.outcome = outcome
        self.down = down
        #: The request had reached the instance when its connection was lost.
        self.sent = sent


def full(instance: Instance) -> Retry:
    """vLLM answered 503 before anything reached the client: another instance is asked."""
    failed = ProxyError(
        ErrorCode.ENGINE_FULL,
        f"every {instance.role} instance tried is full (its engine's queue): try again shortly",
        retry_after=1.0,
        detail=f"{instance.role} instance {instance.url} answered 503 (full)",
    )
    return Retry(failed, "full", None)


class Elsewhere(Exception):
    """The instance answered, but what the leg wants is on another: the next is asked.

    Unlike ``Retry``, nothing counts against the instance: it did its job.
    """

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class PrefillRefused(Exception):
    """Prefill answered 4xx: the answer describes the client's request, relayed as it is."""

    def __init__(self, response: IResponse, body: bytes) -> None:
        super().__init__(response.code)
        self.response = response
        self.body = body


def unreachable(instance: Instance, error: BaseException) -> Retry:
    """The instance could not be reached, or its connection was lost before it answered:
    another may serve the leg (``Retry.sent``: the request may have reached it)."""
    reason = reason_of(error)
    detail = f"{instance.role} instance {instance.url} could not be reached: {reason}"
    message = f"a {instance.role} instance could not be reached"
    failed = ProxyError(codes.unreachable(instance.role), message, detail=detail)
    return Retry(failed, "unreachable", reason, isinstance(error, _SENT))


def timed_out(instance: Instance, seconds: float) -> ProxyError:
    """A 504: the instance did not answer in time."""
    return ProxyError(
        codes.timed_out(instance.role),
        f"a {instance.role} instance did not answer within {seconds:g} s",
        detail=f"{instance.role} instance {instance.url} did not answer within {seconds:g} s",
    )


def unavailable(error: NoHealthyInstance) -> ProxyError:
    """503 with Retry-After: the pool has no instance to send a leg to now."""
    said = "every {} is at its cap" if isinstance(error, NoRoom) else "no healthy {}"
    return ProxyError(
        codes.no_healthy(error.role),
        f"{said.format(error.what)}: try again shortly",
        retry_after=error.retry_after,
    )


def account(
    metrics: ProxyMetrics,
    pool: BackendPool,
    instance: Instance,
    outcome: str,
    down: str | None = None,
) -> None:
    """Count a leg's outcome; ``down`` (why the instance failed) counts toward marking it down."""
    metrics.child(metrics.backend_requests, pool.role, instance.url, outcome).inc()
    if down is None:
        pool.record_success(instance)
    else:
        pool.record_failure(instance, down)


class NoInstanceServed(ProxyError):
    """No instance of the pool could serve the leg: none usable, or each tried failed.

    What the prefill fallback (``--prefill-fallback decode``) catches: the
    instances, not the request, were at fault (unreachable, 502, 503, 504).
    """

    def __init__(self, error: ProxyError) -> None:
        status = None if error.code.status is not None else error.status
        super().__init__(error.code, error.message, error.retry_after, status, error.detail)


def traced(lease: Lease, trace: RequestTrace, attempt: int) -> AttemptTrace:
    """The span of one attempt on ``lease``'s instance (if traced), ending with the lease."""
    span = trace.attempt(lease.instance, lease.decision, lease.pool.policies.default.name, attempt)
    if span is not NO_ATTEMPT:
        lease.on_release = span.end
    return span


def reserve(
    pool: BackendPool,
    metrics: ProxyMetrics,
    routing: Routing = NO_ROUTING,
    room: bool = False,
    avoid: Sequence[Instance] = (),
) -> Lease:
    """The instance the pool's policy chooses now, held for a leg sent later (503: none).

    ``room``: among those under their caps only (``NoRoom`` when none is);
    ``avoid``: not these while another will do (a migration's: the instance
    that failed, taken again when it is the only one left).
    """
    try:
        instance, decision = ByPolicy(pool, metrics, routing, room=room, avoid=avoid)(())
    except NoHealthyInstance as error:
        if avoid:
            return reserve(pool, metrics, routing, room)
        if isinstance(error, NoRoom):
            raise
        raise unavailable(error) from None
    return pool.lease(instance, decision)


class Order(Protocol):
    """Which instance serves a leg's next attempt, and why, given those already tried."""

    @property
    def retries(self) -> int:
        """Attempts after the first."""

    def __call__(self, tried: Sequence[Instance]) -> tuple[Instance, str]:
        """The next instance (``NoHealthyInstance``: none left to try)."""

    def answered(self, served: Any) -> str:
        """A served attempt's outcome, for the access event."""

    def failed(self, instance: Instance) -> None:
        """The attempt on ``instance`` failed: what choosing it set going is undone."""


class ByPolicy:
    """The pool's policy chooses among the instances not tried yet, up to ``retries`` more.

    Counted: a choice after the first as a retry, a leg sent in panic, the decision.
    """

    def __init__(
        self,
        pool: BackendPool,
        metrics: ProxyMetrics,
        routing: Routing,
        retries: int = 0,
        room: bool = False,
        avoid: Sequence[Instance] = (),
    ) -> None:
        """``room``: only instances under their caps (a completion's legs, when capped);
        ``avoid``: never these (``reserve``)."""
        self.pool = pool
        self.metrics = metrics
        self.routing = routing
        self.retries = retries
        self.room = room
        self.avoid = avoid

    def __call__(self, tried: Sequence[Instance]) -> tuple[Instance, str]:
        pool, metrics, routing = self.pool, self.metrics, self.routing
        if tried:
            metrics.retries.labels(pool.role).inc()
        excluded = [*self.avoid, *tried] if self.avoid else tried
        instance, decision = pool.choose(exclude=excluded, routing=routing, room=self.room)
        if pool.panicking:
            metrics.panic_legs.labels(pool.role).inc()
        policy = pool.policy_for(routing.model).name
        metrics.child(metrics.routing_decisions, pool.role, policy, decision).inc()
        matched = routing.matched.get(pool.role)
        if matched is not None:
            metrics.child(metrics.kv_matched_tokens, pool.role).observe(matched)
        return instance, decision

    def answered(self, served: object) -> str:
        return "answered"

    def failed(self, instance: Instance) -> None:
        self.routing.leg_failed(self.pool.role)  # (what kv-aware predicted there will not come)


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Asked:
    """Whose a leg is: its trace, its access record, and whether it is still wanted
    (asked before each attempt)."""

    trace: RequestTrace = NO_TRACE
    record: AccessRecord | None = None
    go_on: Callable[[], bool] = _always


NO_ASKED = Asked()


async def send_leg(
    pool: BackendPool,
    metrics: ProxyMetrics,
    attempt: Callable[[Instance, AttemptTrace], Awaitable[T]],
    order: Order,
    asked: Asked = NO_ASKED,
    reserved: Lease | None = None,
) -> tuple[Lease, T]:
    """Run ``attempt`` on the pool's next instances, as ``order`` chooses, until one serves.

    Returns the lease of the instance that served the leg (the caller
    releases it when the leg is over, a relay included) and what the attempt
    returned. ``asked.go_on`` is asked before each attempt: when it says no,
    the leg ends with ``CancelledError``. A ``reserved`` lease (from
    ``reserve``) is the first attempt's, and is released here if unused.
    Each attempt is its own span of ``asked.trace`` (a retry is a sibling),
    handed to ``attempt`` for its headers, and one of ``asked.record``'s
    attempts (instance, outcome; a served one's outcome is what ``order``
    says of it). Raises ``NoInstanceServed`` when no instance could serve.
    """
    noted = asked.record.attempted if asked.record is not None else _not_noted
    retries = order.retries
    tried: list[Instance] = []
    last: ProxyError | None = None
    try:
        for number in range(1, 2 + retries):
            if not asked.go_on():
                raise CancelledError()
            if reserved is not None and not _still_usable(pool, reserved.instance):
                reserved.release()  # drained, removed or down while prefill ran: choose again
                reserved = None
            if reserved is not None:
                lease, reserved = reserved, None
            else:
                try:
                    chosen, decision = order(tried)
                except NoHealthyInstance as error:
                    raise NoInstanceServed(last or unavailable(error)) from None
                lease = pool.lease(chosen, decision)
            instance = lease.instance
            tried.append(instance)
            span = traced(lease, asked.trace, number)
            try:
                served = await attempt(instance, span)
            except Retry as retry:
                said = retry.down or "full (503)"
                span.fail(f"{said}; another instance is tried" if number <= retries else said)
                lease.release()
                order.failed(instance)
                if retry.down is None:
                    pool.cool(instance)
                    metrics.child(metrics.backend_requests, pool.role, instance.url, "full").inc()
                else:
                    account(metrics, pool, instance, retry.outcome, retry.down)
                noted(pool.role, instance.url, retry.outcome, number > 1)
                last = retry.error
            except Elsewhere as elsewhere:
                lease.release()
                noted(pool.role, instance.url, elsewhere.outcome, number > 1)
            except BaseException as error:
                span.fail(reason_of(error))
                lease.release()
                order.failed(instance)
                noted(pool.role, instance.url, outcome_of(error), number > 1)
                raise
            else:
                noted(pool.role, instance.url, order.answered(served), number > 1)
                return lease, served
        assert last is not None, "the last attempt of a leg was sent Elsewhere"
        raise NoInstanceServed(last)
    finally:
        if reserved is not None:
            reserved.release()  # never sent: the leg ended before its first attempt


def _still_usable(pool: BackendPool, instance: Instance) -> bool:
    """Still in rotation, and up (or the pool in panic, where a down one is as good as any)."""
    if instance.draining or instance not in pool.instances:
        return False
    return pool.panicking or pool.available(instance)


def outcome_of(error: BaseException) -> str:
    """A failed attempt's outcome, for the access event: an error's code, in a word."""
    if isinstance(error, ProxyError):
        return error.code.value
    if isinstance(error, PrefillRefused):
        return f"refused_{error.response.code}"
    if isinstance(error, CancelledError):
        return "cancelled"
    return "failed"


def _not_noted(leg: str, instance: str, outcome: str, again: bool) -> None:
    """No record to note attempts in."""


def reason_of(error: BaseException) -> str:
    """An error as a short reason for a log line or an error message.

    Twisted's client errors (``ResponseFailed``, ``ResponseNeverReceived``)
    carry a list of ``Failure`` s whose ``str`` is a list of Python reprs:
    each is said by its message instead.
    """
    reasons = getattr(error, "reasons", None)
    if isinstance(reasons, list) and reasons:
        said = [
            reason_of(r.value) if isinstance(r, Failure) and r.value is not None else str(r)
            for r in reasons
        ]
        return "; ".join(dict.fromkeys(said))
    return str(error) or type(error).__name__
