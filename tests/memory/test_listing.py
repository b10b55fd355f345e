"""``/v1/models`` as the proxy lists it passes admission's one step, counted for its tenant
only: the instances' listing is no instance's work, so it is served while draining and
past ``--max-in-flight``, and held to its tenant's requests per minute."""

from __future__ import annotations

from nixl_twisted.protocol import routes
from tests.memory.test_models import two_models


def test_the_listing_is_held_to_its_tenant_not_to_the_proxys_in_flight_or_its_drain() -> None:
    setup = two_models(max_in_flight=1, tenant_header="x-team", tenant_requests_per_minute=1)
    admission = setup.proxy.app.admission
    admission.admit()  # (the proxy's one slot, taken)
    team = {"x-team": "a"}
    listed = setup.get(routes.MODELS, team).answer()
    assert listed.status == 200 and listed.json()["data"]
    admission.start_draining()
    assert setup.get(routes.MODELS, {"x-team": "b"}).answer().status == 200
    refused = setup.get(routes.MODELS, team).answer()
    assert refused.status == 429
    assert admission.in_flight == 1  # (none of them counted in it)
