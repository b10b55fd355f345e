"""``docs/architecture.md`` held to the code where it names a signature.

Every call its diagrams write as ``name(args)`` is a callable of the proxy's
(``SIGNED`` says which), and its arguments are that callable's parameters,
by name and in order: ``...`` stands for any run of them, and parameters
left off the end must have defaults. A constructor or a function that
gains, loses or renames a parameter fails here until the diagram says so.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest

import nixl_twisted
from nixl_twisted.admission.gate import Admission
from nixl_twisted.admission.limits import TenantLimits
from nixl_twisted.admission.shared_slots import SharedSlots
from nixl_twisted.admission.slots import Slots
from nixl_twisted.admission.tenancy import Tenancy
from nixl_twisted.admission.windows import SharedWindows
from nixl_twisted.backends.checks import HealthChecks
from nixl_twisted.backends.leases import Lease
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.prompt_keys import routing_for
from nixl_twisted.backends.service import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.discovery.service import Discovery
from nixl_twisted.exchange.decide import decide
from nixl_twisted.exchange.decode_leg import DecodeLeg
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.migration import Migrations, Moved
from nixl_twisted.exchange.placing import place, place_now, place_prefill
from nixl_twisted.exchange.prefill_leg import PrefillLeg
from nixl_twisted.exchange.relay import relay
from nixl_twisted.exchange.sending import reserve, send_leg
from nixl_twisted.exchange.serving import Serving
from nixl_twisted.exchange.two_legs import Exchange
from nixl_twisted.fleet.replicas import Replicas
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.scrape_metrics import ScrapeMetrics
from nixl_twisted.protocol.completion import Completion, read_completion
from nixl_twisted.run import reloads
from nixl_twisted.run.coordination import SupervisorLink
from nixl_twisted.run.proxy_service import ProxyService
from nixl_twisted.run.root import backend_pools
from nixl_twisted.web import door
from nixl_twisted.web.admin import AdminAPI
from nixl_twisted.web.app import ProxyApp
from nixl_twisted.web.backends_view import BackendsView
from nixl_twisted.web.keys import ClientKeys
from nixl_twisted.web.site import TrackingSite
from nixl_twisted.web.status import StatusPage
from tests.pure.test_rooms import PACKAGE

#: What each name the diagrams call stands for (a method by the name of what holds it).
SIGNED: dict[str, Callable[..., Any]] = {
    "meta": nixl_twisted.meta,
    "reloads.reloaded": reloads.reloaded,
    "ProxyConfig.to_json": ProxyConfig.to_json,
    "ProxyConfig.from_json": ProxyConfig.from_json,
    "backend_pools": backend_pools,
    "BackendPool": BackendPool,
    "ProxyMetrics": ProxyMetrics,
    "KvEvents": KvEvents,
    "BackendService": BackendService,
    "HealthChecks": HealthChecks,
    "Discovery": Discovery,
    "SupervisorLink": SupervisorLink,
    "link.on_reloaded": SupervisorLink.on_reloaded,
    "Slots": Slots,
    "ScrapeMetrics": ScrapeMetrics,
    "metrics.read_at_scrape": ProxyMetrics.read_at_scrape,
    "BackendsView": BackendsView,
    "AdminAPI": AdminAPI,
    "Legs": Legs,
    "Serving": Serving,
    "ClientKeys": ClientKeys,
    "TenantLimits": TenantLimits,
    "SharedWindows": SharedWindows,
    "Tenancy": Tenancy,
    "Admission": Admission,
    "StatusPage": StatusPage,
    "ProxyApp": ProxyApp,
    "TrackingSite": TrackingSite,
    "ProxyService": ProxyService,
    "ProxyApp._two_legs": ProxyApp._two_legs,
    "door.completion": door.completion,
    "read_completion": read_completion,
    "tenancy.admit": Tenancy.admit,
    "completion.admitted": Completion.admitted,
    "admission.serve": Admission.serve,
    "admission.request": Admission.request,
    "Replicas": Replicas,
    "SharedSlots": SharedSlots,
    "serving.completion": Serving.completion,
    "Exchange": Exchange,
    "Exchange.start": Exchange.start,
    "routing_for": routing_for,
    "place_now": place_now,
    "place": place,
    "place_prefill": place_prefill,
    "slots.take_decode": Slots.take_decode,
    "reserve": reserve,
    "decide": decide,
    "PrefillLeg": PrefillLeg,
    "PrefillLeg.send": PrefillLeg.send,
    "completion.prefill_bytes": Completion.prefill_bytes,
    "completion.decode_bytes": Completion.decode_bytes,
    "completion.decode_only_bytes": Completion.decode_only_bytes,
    "send_leg": send_leg,
    "DecodeLeg": DecodeLeg,
    "DecodeLeg.send": DecodeLeg.send,
    "relay": relay,
    "Exchange._legs": Exchange._legs,
    "Exchange._pair": Exchange._pair,
    "moves.move": Migrations.move,
    "Moved": Moved,
    "moves.again": Migrations.again,
    "lease.release": Lease.release,
}

#: ``name(args)``, then any calls chained on its result (``Exchange(...).start()``).
CALL = re.compile(r"(?<![\w.)])([A-Za-z_][\w.]*)\(([^()]*)\)((?:\.\w+\([^()]*\))*)")
CHAINED = re.compile(r"\.(\w+)\(([^()]*)\)")


def named_calls(doc: str) -> list[tuple[str, list[str]]]:
    """Every call the doc's fenced blocks write: its name and its arguments as written."""
    calls = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", doc, re.M | re.S):
        for call in CALL.finditer(block):
            name, written, chained = call.groups()
            calls.append((name, _arguments(written)))
            for method, more in CHAINED.findall(chained):
                calls.append((f"{name}.{method}", _arguments(more)))
    return calls


def _arguments(written: str) -> list[str]:
    return [a.strip() for a in written.split(",") if a.strip()]


def parameters(callable_: Callable[..., Any]) -> list[inspect.Parameter]:
    """Its parameters as a caller writes them (no ``self``, no ``cls``)."""
    found = list(inspect.signature(callable_).parameters.values())
    return [p for p in found if p.name not in ("self", "cls")]


def matches(written: Sequence[str], taken: Sequence[inspect.Parameter]) -> bool:
    """Whether ``written`` names ``taken`` in order, ``...`` for any run of them."""
    if not written:
        return all(p.default is not inspect.Parameter.empty for p in taken)
    if written[0] == "...":
        return any(matches(written[1:], taken[i:]) for i in range(len(taken) + 1))
    return bool(taken) and taken[0].name == written[0] and matches(written[1:], taken[1:])


DOC = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")


def test_every_call_the_architecture_names_is_a_known_callable() -> None:
    unknown = {name for name, _ in named_calls(DOC)} - set(SIGNED)
    assert unknown == set(), "name each in SIGNED, or write it as prose"


@pytest.mark.parametrize(("name", "written"), named_calls(DOC), ids=lambda x: str(x))
def test_each_named_call_has_its_callables_parameters(name: str, written: list[str]) -> None:
    taken = parameters(SIGNED[name])
    assert matches(written, taken), f"{name}({', '.join(p.name for p in taken)})"


def test_a_drifted_signature_is_caught() -> None:
    def made(config: object, fleet: object, status: object = None) -> None:
        """A constructor as the code has it."""

    taken = parameters(made)
    assert matches(["config", "fleet"], taken)
    assert matches(["config", "...", "status"], taken)
    assert not matches(["config"], parameters(lambda config, fleet: None))
    assert not matches(["config", "serving"], taken)
    assert not matches(["config", "fleet", "status", "extra"], taken)
    assert named_calls("```\nA(x, y).go(z) then b.c()\n```\n") == [
        ("A", ["x", "y"]),
        ("A.go", ["z"]),
        ("b.c", []),
    ]
