"""A routing policy is its module and one line of the registry: one added here, in the test,
is read for what it declares wherever a policy's needs are asked, and named nowhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor
from twisted.web.client import Agent

from nixl_twisted.backends import policies
from nixl_twisted.backends.policies import Declared, Needs
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.prompt_keys import routing_for
from nixl_twisted.backends.routing import Candidate, Choice, Pool, Routing
from nixl_twisted.backends.service import BackendService
from nixl_twisted.backends.upstream import Upstream
from nixl_twisted.config import ProxyConfig
from nixl_twisted.exchange.tokens import wanted
from nixl_twisted.observe.history import Sample, point
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.completion import Completion


def quietest(pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
    """The candidate vLLM says runs least, the session's own breaking ties."""
    least = min(c.load.get("running", 0.0) for c in candidates)
    quiet = [c for c in candidates if c.load.get("running", 0.0) == least]
    named = [c for c in quiet if routing.session is not None and routing.session in c.url]
    return (named or quiet)[0], "quietest"


def by_blocks(pool: Pool, candidates: Sequence[Candidate], routing: Routing) -> Choice:
    return candidates[0], "blocks"


@pytest.fixture
def added(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two policies, each added as a new one is: one line of the registry."""
    for kind in (
        Declared("quietest", Needs(session_key=True, load=True), lambda parts: quietest),
        Declared("by-blocks", Needs(token_ids=True, kv_events=True), lambda parts: by_blocks),
    ):
        monkeypatch.setitem(policies.REGISTRY, kind.name, kind)


CONFIG = ProxyConfig.create(
    prefill=["http://p-alice:1", "http://p-bob:1"], decode=["http://d1:1"], health_interval=0
)
RULES = CONFIG.rules_for(None)


def service(prefill: str, decode: str = "round-robin") -> BackendService:
    config = CONFIG
    clock = Clock()
    backends = BackendService(
        BackendPool("prefill", config.pools.static("prefill"), clock),
        BackendPool("decode", config.pools.static("decode"), clock),
        Upstream(Agent(MemoryReactor())),
        config,
    )
    # (The settings check names against ``config.values.POLICIES``: given as parsed.)
    backends.use_policies(replace(config.policies, prefill=prefill, decode=decode))
    return backends


def hit_rate(name: str) -> dict[str, float]:
    """The status page's prefix hit rate, for a policy that decided ``prefix`` once in two."""
    decided = Sample(1.0, routing={(name, "prefix"): 1.0, (name, "next"): 1.0})
    return dict(point(decided, Sample(0.0), Sample(0.0))["prefix_hit_rate"])


def chat(user: str) -> Completion:
    body = {"messages": [{"role": "user", "content": "hello " * 40}], "user": user}
    return Completion(routes.CHAT_COMPLETIONS, body, "r")


@pytest.mark.usefixtures("added")
def test_a_policy_that_reads_load_and_sessions_is_served_both_and_nothing_else() -> None:
    backends = service("quietest")
    prefill, decode = backends.pools()
    assert (prefill.reads_load, prefill.reads_events, prefill.sent.entries) == (True, False, 0)
    assert not decode.reads_load
    assert backends.needs(None) == Needs(session_key=True, load=True)
    routing = routing_for(backends.needs(None), 512, None, chat("bob"))
    assert routing == Routing(session="bob")  # (no prompt rendered: nothing reads it)
    prefill.instances[0].load = {"running": 3.0}
    prefill.instances[1].load = {"running": 3.0}
    assert prefill.choose(routing=routing) == (prefill.instances[1], "quietest")
    assert prefill.policy_for(None).name == "quietest"
    assert wanted(backends, RULES, None, True) is None
    assert hit_rate("quietest") == {}  # (it looks for no prefix: not charted)


@pytest.mark.usefixtures("added")
def test_a_policy_that_reads_token_ids_and_kv_events_has_them_rendered_and_followed() -> None:
    backends = service("round-robin", decode="by-blocks")
    prefill, decode = backends.pools()
    assert (decode.reads_events, decode.reads_load, prefill.reads_events) == (True, False, False)
    routing = routing_for(backends.needs(None), 512, None, chat("bob"))
    assert routing.session is None and routing.prompt is not None and routing.prompt_bytes
    assert wanted(backends, RULES, None, False) is decode
    assert hit_rate("by-blocks") == {"by-blocks": 0.5}


def test_each_policy_of_the_registry_declares_what_the_routing_docs_say_it_reads() -> None:
    declared = {name: kind.needs for name, kind in policies.REGISTRY.items()}
    assert declared["round-robin"] == declared["least-loaded"] == policies.NOTHING
    assert declared["load"] == Needs(load=True)
    assert declared["session"] == Needs(session_key=True)
    assert declared["cache-aware"] == Needs(prompt_text=True, sent_prefixes=True)
    assert declared["kv-aware"] == Needs(
        prompt_text=True, token_ids=True, kv_events=True, sent_prefixes=True
    )
    finding = {name for name in policies.REGISTRY if policies.finds_prefixes(name)}
    assert finding == {"cache-aware", "kv-aware"}
