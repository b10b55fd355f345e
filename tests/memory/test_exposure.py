"""What a client endpoint shows of the fleet: ``/healthcheck`` in full and ``/metrics``.

They name every instance's URL, the process id and each instance's last
error. With no ``--admin-listen``, the client endpoint shows them to anyone
while every client is served, and to the admin token alone once clients
need a key; readiness and ``/health`` stay open to load balancers.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import formatEvent

from nixl_twisted.config import ProxyConfig
from tests.memory.support import Setup

KEY = "sk-client"
TOKEN = "admin-secret-token"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def healthcheck(setup: Setup, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    answer = setup.get("/healthcheck", headers).answer()
    return answer.status, answer.json()


def metrics(setup: Setup, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    answer = setup.get("/metrics", headers).answer()
    return answer.status, answer.body


def test_without_client_keys_the_client_endpoint_shows_the_backends_to_anyone() -> None:
    setup = Setup()
    status, health = healthcheck(setup)
    assert status == 200
    assert {"pid", "instances"} <= set(health)
    assert health["instances"]["decode"][0]["url"] == setup.decode.url
    status, body = metrics(setup)
    assert status == 200 and b"nixlproxy_" in body


def test_with_client_keys_and_no_admin_token_it_shows_readiness_alone(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup(api_key=[KEY])
    for headers in (None, bearer(KEY)):  # (a client's key is not the admin token)
        assert healthcheck(setup, headers) == (200, {"ready": True})
        status, body = metrics(setup, headers)
        assert status == 401
        assert setup.decode.url.encode() not in body
    answer = setup.get("/metrics").answer()
    assert answer.json()["error"] == {
        "message": "while clients need a key, /metrics on this endpoint needs the admin token "
        "(Authorization: Bearer TOKEN); or serve it on --metrics-listen or --admin-listen",
        "type": "authentication_error",
        "param": None,
        "code": "unauthorized",
    }
    health = setup.get("/health").answer()  # a load balancer's probe: open, as vLLM's
    assert (health.status, health.body) == (200, b"")
    # A scraper without the token is answered, not logged at every scrape.
    assert not [e for e in logged if "refused" in formatEvent(e)]


def test_with_client_keys_the_admin_token_sees_the_fleet() -> None:
    setup = Setup(api_key=[KEY], admin_token=TOKEN)
    status, health = healthcheck(setup, bearer(TOKEN))
    assert status == 200 and health["instances"]["prefill"][0]["url"] == setup.prefill.url
    status, body = metrics(setup, bearer(TOKEN))
    assert status == 200 and b"nixlproxy_" in body
    for wrong in (bearer("wrong-token"), {"Authorization": TOKEN}, bearer(KEY)):
        assert healthcheck(setup, wrong) == (200, {"ready": True})
        assert metrics(setup, wrong)[0] == 401


def test_not_ready_is_still_said_without_the_token() -> None:
    setup = Setup(api_key=[KEY])
    setup.proxy.app.admission.leaving = True  # (as during --shutdown-delay)
    assert healthcheck(setup) == (503, {"ready": False})
    assert setup.get("/health").answer().status == 503


def test_keys_added_by_a_reload_close_the_fleet_off_at_once() -> None:
    setup = Setup()
    assert metrics(setup)[0] == 200
    pools = {"prefill": [setup.prefill.url], "decode": [setup.decode.url], "health_interval": 0}
    setup.proxy.service.reconfigure(ProxyConfig.create(**pools, api_key=[KEY]))
    assert metrics(setup)[0] == 401
    assert healthcheck(setup) == (200, {"ready": True})
