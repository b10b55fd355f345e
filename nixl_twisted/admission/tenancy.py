"""Whose each request is, and its tenant's limits held from its admission to its end.

The tenant is the client key's (``KeyTenants``: ``web.keys.ClientKeys``), else ``--tenant-header``'s
value. A request is counted by ``TenantLimits`` when its tenant has a limit,
charged while it runs the most it may use (``protocol.charges``), and, when
it ends, the tokens vLLM's usage says it used instead. Requests and tokens per
minute are counted for every process in ``--limits-redis`` (``windows``),
requests in flight for every replica in ``--replicas-redis`` (``shared_tenants``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from nixl_twisted.admission.limits import MAX_NAME, NO_HOLD, TenantLimits
from nixl_twisted.admission.shared_tenants import Alone, Place, PlaceRefused
from nixl_twisted.admission.tenant_places import LocalTenants, TenantPlaces
from nixl_twisted.admission.windows import SharedWindows, Verdict
from nixl_twisted.config import NO_RULE, TenantRule
from nixl_twisted.config.words import counted
from nixl_twisted.observe.access import record_of
from nixl_twisted.protocol import lowering
from nixl_twisted.protocol.completion import Completion


class KeyTenants(Protocol):
    """The clients' keys: whether a request must carry one, and whose tenant it names."""

    @property
    def required(self) -> bool: ...

    def tenant(self, headers: Headers, path: bytes) -> str | None: ...


class Tenancy:
    """A request's tenant, found and held to its limits (``TenantLimits``)."""

    def __init__(
        self,
        keys: KeyTenants,
        limits: TenantLimits,
        context_of: Callable[[object], int | None] = lambda model: None,
        shared: SharedWindows | None = None,
        fleet: TenantPlaces | None = None,
    ) -> None:
        """``fleet``: where requests in flight are held to their limit for every replica
        (``SharedTenants``), else here (``LocalTenants``)."""
        self.keys = keys
        self.limits = limits
        #: A model's context length (``max_model_len``), as its instances say (None: unknown).
        self.context_of = context_of
        #: Where requests and tokens per minute are counted for every process (None: here).
        self.shared = shared
        #: Where requests in flight are held to their limit: here, or for every replica.
        self.places: TenantPlaces = fleet if fleet is not None else LocalTenants(limits)

    def tenant(self, request: Request, path: str) -> str | None:
        """Whose the request is: its client key's tenant, else the tenant header's."""
        headers = request.requestHeaders
        if self.keys.required:
            return self.keys.tenant(headers, path.encode("utf-8"))
        if self.limits.header is None:
            return None
        named = headers.getRawHeaders(self.limits.header, [None])[0]
        return lowering.printable(named.decode("utf-8", "replace")) if named else None

    def admit(
        self, request: Request, path: str, completion: Completion | None = None
    ) -> TenantRule | Deferred[TenantRule]:
        """Hold the request to its tenant's limits (429 past one) until it ends; its rule
        (a Deferred when Redis counts the tenant's windows, ``--limits-redis``, or its
        requests in flight, ``--replicas-redis``).

        ``completion`` None: a request that generates no tokens (models,
        tokenize, a stored response), held to in flight and requests per
        minute only.
        """
        tenant = self.tenant(request, path)
        if tenant is None:
            return NO_RULE
        tenant = record_of(request).tenant = tenant[:MAX_NAME]  # (as it is counted)
        rule = self.limits.rule(tenant)
        if not rule.counted:
            return rule  # (the common case: nothing to count, no prompt to measure)
        tpm = rule.tokens_per_minute if completion is not None else 0
        estimate = None if completion is None else 0
        if completion is not None and tpm:
            estimate = completion.charge(self.context_of(completion.model))
        held = Holding(request, estimate)
        request.notifyFinish().addBoth(held.ended)
        places, limit = self.places, rule.max_in_flight
        if self.shared is None or not (rule.requests_per_minute or tpm):
            if limit:
                places.check(tenant, limit)
            held.hold = self.limits.admit(tenant, estimate, in_flight=False)
            return self._in_flight(tenant, rule, held) if limit else rule
        # In flight (a 429 at once when held here), then the windows in Redis.
        if limit:
            places.check(tenant, limit)
        held.hold = self.limits.admit(tenant, estimate, windows=False, in_flight=False)
        shared = self.shared

        def decided(verdict: Verdict | None) -> TenantRule | Deferred[TenantRule]:
            if held.over:  # (its client left while Redis was asked)
                if verdict is not None and verdict.admitted and tpm:
                    shared.charge(tenant, verdict.member, 0)  # (its estimate, given back)
                raise CancelledError()
            if verdict is None:  # (Redis could not say: this process decides)
                held.give_back()
                if limit:
                    places.check(tenant, limit)
                held.hold = self.limits.admit(tenant, estimate, in_flight=False)
            elif not verdict.admitted:
                held.give_back()
                raise self.limits.refused(tenant, verdict.limit, verdict.wait)
            elif tpm:
                held.charge = lambda used: shared.charge(tenant, verdict.member, used)
            return self._in_flight(tenant, rule, held) if limit else rule

        return shared.ask(tenant, rule.requests_per_minute, tpm, estimate).addCallback(decided)

    def _in_flight(
        self, tenant: str, rule: TenantRule, held: Holding
    ) -> TenantRule | Deferred[TenantRule]:
        """The tenant's place among its requests in flight: at once when held here, else
        over every replica (``--replicas-redis``), or, while Redis does not answer, this
        replica's share of its limit."""
        places = self.places

        def placed(place: Place | PlaceRefused | Alone) -> TenantRule:
            if isinstance(place, Place):
                if held.over:  # (its client left while Redis was asked)
                    places.release(place)
                    raise CancelledError()
                held.place = lambda: places.release(place)
                return rule
            limit = rule.max_in_flight
            if isinstance(place, Alone):  # (Redis could not say: this replica's share)
                limit = places.share(limit)
                if self.limits.in_flight(tenant) <= limit:
                    return rule
            held.give_back()
            raise self.limits.refused(tenant, f"{counted(limit, 'request')} in flight", 1.0)

        got = places.admit(tenant, rule.max_in_flight)
        if isinstance(got, Deferred):
            return got.addCallback(placed)
        return placed(got)


class Holding:
    """What a request holds of its tenant's limits, given back when it ends."""

    def __init__(self, request: Request, estimate: int | None) -> None:
        self.request = request
        self.estimate = estimate
        self.hold = NO_HOLD
        #: Given what it used, in Redis, when its windows are counted there.
        self.charge: Callable[[int], None] | None = None
        #: Its place among its tenant's requests in flight over every replica, given back.
        self.place: Callable[[], None] | None = None
        self.over = False

    def give_back(self) -> None:
        """Out of flight, charged nothing (refused, or counted again another way)."""
        hold, self.hold = self.hold, NO_HOLD
        hold.release(0)

    def ended(self, _: object) -> None:
        self.over = True
        usage = record_of(self.request).total_usage()
        if usage is not None:
            used = (usage.prompt_tokens or 0) + (usage.completion_tokens or 0)
        elif 200 <= self.request.code < 300:
            used = self.estimate or 0  # (answered, but vLLM said nothing of its usage)
        else:
            used = 0  # (refused or failed: nothing generated is charged)
        self.hold.release(used)
        if self.charge is not None:
            self.charge(used)
        if self.place is not None:
            place, self.place = self.place, None
            place()
