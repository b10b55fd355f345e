"""The Responses API's follow-ups in memory: the holder first, then each decode instance.

A follow-up is a leg like any other (``send_leg``) whose instances come in
its own order (``HolderFirst``): no routing decision and no retry is
counted, and each instance asked is one attempt of the access event.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.logger import ILogObserver, globalLogPublisher
from zope.interface import provider

from nixl_twisted.exchange.responses import ResponseDirectory
from nixl_twisted.testing import FakeVLLM, InMemoryProxy, TransferLedger


@pytest.fixture
def access() -> Iterator[list[dict[str, Any]]]:
    """The fields of each access event while the test runs."""
    events: list[dict[str, Any]] = []

    @provider(ILogObserver)
    def observer(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "nixlproxy.access":
            events.append(event["access"])

    globalLogPublisher.addObserver(observer)
    yield events
    globalLogPublisher.removeObserver(observer)


class Setup:
    def __init__(self) -> None:
        ledger = TransferLedger()
        self.prefill = FakeVLLM(name="prefill-0", ledger=ledger)
        self.decodes = [FakeVLLM(name=f"decode-{i}", ledger=ledger) for i in range(2)]
        self.proxy = InMemoryProxy([self.prefill], self.decodes)

    def create(self) -> str:
        """A stored response (round-robin: on the next decode instance); its id."""
        body = json.dumps({"model": "m", "input": "x"}).encode()
        client = self.proxy.request(
            "POST", "/v1/responses", body, {"Content-Type": "application/json"}
        )
        answer = client.answer()
        assert answer.status == 200
        return str(answer.json()["id"])

    def get(self, response_id: str) -> tuple[int, Any]:
        answer = self.proxy.request("GET", f"/v1/responses/{response_id}").answer()
        return answer.status, answer.json()

    def counted(self, name: str) -> float:
        registry = self.proxy.app.metrics.registry
        return sum(
            sample.value
            for family in registry.collect()
            for sample in family.samples
            if sample.name == name and sample.labels.get("pool") == "decode"
        )


def test_the_holder_is_asked_first_and_alone(access: list[dict[str, Any]]) -> None:
    setup = Setup()
    setup.create()
    held = setup.create()  # on decode-1
    decisions = setup.counted("nixlproxy_routing_decisions_total")
    status, body = setup.get(held)
    assert (status, body["id"]) == (200, held)
    assert [r.path for r in setup.decodes[0].requests if r.role == "other"] == []
    event = access[-1]
    assert event["decode"] == setup.decodes[1].url and event["decode_status"] == 200
    assert "attempts" not in event  # one attempt: nothing retried to list
    assert setup.counted("nixlproxy_routing_decisions_total") == decisions


def test_an_unknown_response_passes_over_each_404_to_the_one_that_holds_it(
    access: list[dict[str, Any]],
) -> None:
    setup = Setup()
    setup.create()
    held = setup.create()  # on decode-1
    setup.proxy.app.serving.responses = ResponseDirectory()  # a restart: the holder unknown
    decisions = setup.counted("nixlproxy_routing_decisions_total")
    status, body = setup.get(held)
    assert (status, body["id"]) == (200, held)
    first, second = (d.url for d in setup.decodes)
    assert access[-1]["attempts"] == [
        f"decode {first} answered_404",
        f"decode {second} answered_200",
    ]
    # Neither a policy's choice nor a retry: the metrics say so.
    assert setup.counted("nixlproxy_routing_decisions_total") == decisions
    assert setup.counted("nixlproxy_retries_total") == 0
    # The instance that answered 404 did its job: nothing counts against it.
    assert [i.failures for i in setup.proxy.service.backends.decode.instances] == [0, 0]
    assert [i.in_flight for i in setup.proxy.service.backends.decode.instances] == [0, 0]


def test_when_no_instance_holds_it_the_last_404_is_the_answer(
    access: list[dict[str, Any]],
) -> None:
    setup = Setup()
    status, body = setup.get("resp_nope")
    assert status == 404 and "resp_nope" in body["error"]["message"]
    first, second = (d.url for d in setup.decodes)
    assert access[-1]["attempts"] == [
        f"decode {first} answered_404",
        f"decode {second} answered_404",
    ]


class Tenants(Setup):
    """Two tenants, each with its key (``alpha``, ``low``)."""

    def __init__(self, keys: Any, per_tenant: int = 1000) -> None:
        keys.write_text("sk-alpha alpha\nsk-low low\n")
        ledger = TransferLedger()
        self.prefill = FakeVLLM(name="prefill-0", ledger=ledger)
        self.decodes = [FakeVLLM(name=f"decode-{i}", ledger=ledger) for i in range(2)]
        self.proxy = InMemoryProxy(
            [self.prefill], self.decodes, api_keys_file=str(keys), responses_per_tenant=per_tenant
        )

    def as_(self, key: str, method: str, path: str, body: object = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        sent = json.dumps(body).encode() if body is not None else b""
        answer = self.proxy.request(method, path, sent, headers).answer()
        return answer.status, answer.json()

    def made(self, key: str) -> str:
        status, body = self.as_(key, "POST", "/v1/responses", {"model": "m", "input": "x"})
        assert status == 200, body
        return str(body["id"])

    def asked(self) -> list[str]:
        """What the decode instances were asked of stored responses."""
        return [r.path for d in self.decodes for r in d.requests if r.role == "other"]


def _not_found(response_id: str) -> dict[str, Any]:
    message = f"Response with id '{response_id}' not found."
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found",
        }
    }


def test_another_tenants_stored_response_is_not_found(tmp_path: Any) -> None:
    setup = Tenants(tmp_path / "keys")
    theirs = setup.made("sk-alpha")
    for method, path in (
        ("GET", f"/v1/responses/{theirs}"),
        ("POST", f"/v1/responses/{theirs}/cancel"),
    ):
        assert setup.as_("sk-low", method, path, {} if method == "POST" else None) == (
            404,
            _not_found(theirs),
        )
    assert setup.asked() == []  # (no decode instance asked for it)
    status, body = setup.as_("sk-alpha", "GET", f"/v1/responses/{theirs}")
    assert (status, body["id"]) == (200, theirs)  # its owner's, still


def test_with_tenants_an_id_whose_owner_is_unknown_is_asked_of_no_instance(
    tmp_path: Any,
) -> None:
    setup = Tenants(tmp_path / "keys")
    theirs = setup.made("sk-alpha")
    setup.proxy.app.serving.responses = ResponseDirectory()  # a restart: its owner unknown
    assert setup.as_("sk-alpha", "GET", f"/v1/responses/{theirs}") == (404, _not_found(theirs))
    assert setup.as_("sk-low", "GET", "/v1/responses/resp_nope") == (
        404,
        _not_found("resp_nope"),
    )
    assert setup.asked() == []


def test_the_routes_the_proxy_does_not_serve_reach_no_instance(tmp_path: Any) -> None:
    setup = Tenants(tmp_path / "keys")
    theirs = setup.made("sk-alpha")
    for method, path, body, refused in (
        ("DELETE", f"/v1/responses/{theirs}", None, (405, "method_not_allowed")),
        ("GET", f"/v1/responses/{theirs}/input_items", None, (404, "not_found")),
        (
            "POST",
            "/v1/responses",
            {"model": "m", "input": "y", "previous_response_id": theirs},
            (400, "previous_response_id_unsupported"),
        ),
    ):
        status, answer = setup.as_("sk-low", method, path, body)
        assert (status, answer["error"]["code"]) == refused
    assert setup.asked() == []
    assert len(setup.decodes[0].requests) + len(setup.decodes[1].requests) == 1  # (the made)


def test_each_tenant_keeps_its_latest_responses_the_oldest_forgotten_first(
    tmp_path: Any,
) -> None:
    setup = Tenants(tmp_path / "keys", per_tenant=2)
    first, second, third = (setup.made("sk-alpha") for _ in range(3))
    low = setup.made("sk-low")  # (another tenant's count: its own)
    directory = setup.proxy.app.serving.responses
    assert [directory.where(i) is not None for i in (first, second, third, low)] == [
        False,
        True,
        True,
        True,
    ]
    assert setup.as_("sk-alpha", "GET", f"/v1/responses/{first}") == (404, _not_found(first))
    assert setup.as_("sk-alpha", "GET", f"/v1/responses/{third}")[0] == 200
