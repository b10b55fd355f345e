"""A request is read once at the door: its body parsed once, each leg's body encoded once,
its prompt measured once and its messages rendered once, whatever reads them after."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from nixl_twisted.protocol import completion, handoff, lowering, routes
from tests.memory.support import FULL_CHAT, Setup

F = TypeVar("F", bound=Callable[..., Any])


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How often the proxy parses a body, encodes a leg's, measures and renders a prompt."""
    counted: Counter[str] = Counter()

    def counting(name: str, function: F) -> F:
        def call(*args: Any, **kwargs: Any) -> Any:
            counted[name] += 1
            return function(*args, **kwargs)

        return call  # type: ignore[return-value]

    monkeypatch.setattr(lowering, "read_json", counting("json", lowering.read_json))
    monkeypatch.setattr(handoff, "read_json", counting("json", handoff.read_json))
    parse = counting("parsed", lowering.parse_client_body)
    monkeypatch.setattr(lowering, "parse_client_body", parse)
    monkeypatch.setattr(lowering, "encode", counting("encoded", lowering.encode))
    monkeypatch.setattr(completion, "measure", counting("measured", completion.measure))
    monkeypatch.setattr(completion, "render", counting("rendered", completion.render))
    yield counted


def test_a_chat_completion_is_read_once_whatever_reads_it(calls: Counter[str]) -> None:
    # Every reader at once: cache-aware routing on both pools (the prompt's key and
    # chain), a decode-only rule that is not met (the estimate), a tenant whose
    # tokens per minute count (the charge, and a stream asking for usage), a
    # priority (a variant of the body).
    setup = Setup(
        prefill_policy="cache-aware",
        decode_policy="cache-aware",
        decode_only_below=2,
        tenant_header="x-team",
        tenant_tokens_per_minute=100_000,
        tenant_priority=5,
    )
    chat = dict(FULL_CHAT, stream=True, max_tokens=4)
    answer = setup.post(routes.CHAT_COMPLETIONS, chat, {"x-team": "team-a"}).answer()
    assert answer.status == 200
    sent = setup.prefill.requests[-1].body
    assert sent is not None and sent["priority"] == 5  # the variant was sent
    # JSON read twice: the client's body, and prefill's answer (its kv_transfer_params).
    assert calls == Counter(parsed=1, json=2, encoded=2, measured=1, rendered=1)
