"""A tenant's requests in flight held here (no ``--replicas-redis``): ``Tenancy`` holds one
``TenantPlaces`` and the local one answers at once, its 429 raised in the same turn."""

from __future__ import annotations

from typing import cast

import pytest
from twisted.internet.task import Clock
from twisted.web.http_headers import Headers
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyRequest

from nixl_twisted.admission.limits import TenantLimits
from nixl_twisted.admission.tenancy import Tenancy
from nixl_twisted.config import ProxyConfig, TenantRule
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.protocol.errors import ProxyError


class NoKeys:
    required = False

    def tenant(self, headers: Headers, path: bytes) -> str | None:
        return None


def team_request() -> Request:
    request = DummyRequest([b"v1", b"models"])
    request.requestHeaders.setRawHeaders(b"x-team", [b"team-a"])
    request.access = AccessRecord()  # type: ignore[attr-defined]
    request.code = 200  # type: ignore[attr-defined]
    return cast(Request, request)


def tenancy(**settings: object) -> Tenancy:
    limits = TenantLimits(Clock())
    config = ProxyConfig.create(
        prefill=["http://p:1"], decode=["http://d:1"], tenant_header="x-team", **settings
    )
    limits.configure(config)
    return Tenancy(NoKeys(), limits)


def test_a_tenant_past_its_limit_in_flight_here_is_refused_in_the_same_turn() -> None:
    held = tenancy(tenant_max_in_flight=1)
    first = team_request()
    assert isinstance(held.admit(first, "/v1/models"), TenantRule)  # (not a Deferred)
    with pytest.raises(ProxyError) as refused:
        held.admit(team_request(), "/v1/models")
    assert refused.value.status == 429
    assert "1 request in flight" in str(refused.value)
    cast(DummyRequest, first).finish()  # (its place given back: the next one goes)
    assert isinstance(held.admit(team_request(), "/v1/models"), TenantRule)
