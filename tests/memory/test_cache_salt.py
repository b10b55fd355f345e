"""``cache_salt``: checked at the door as vLLM checks it, carried on both legs."""

from __future__ import annotations

from typing import Any

import pytest

from nixl_twisted.protocol import routes
from tests.memory.support import FULL_CHAT, Setup, assert_error


@pytest.mark.parametrize("salt", ["", 7, ["a"], "a@b", "a/b", "a\\b", "a\0b", "s" * 129])
def test_a_salt_vllm_would_refuse_is_a_400_before_any_leg(salt: Any) -> None:
    setup = Setup()
    answer = setup.post(routes.CHAT_COMPLETIONS, dict(FULL_CHAT, cache_salt=salt)).answer()
    assert_error(answer, 400, "invalid_cache_salt")
    assert "'cache_salt' must be" in answer.json()["error"]["message"]
    assert setup.prefill.requests == [] and setup.decode.requests == []


@pytest.mark.parametrize("path", [routes.CHAT_COMPLETIONS, routes.COMPLETIONS])
def test_a_clients_salt_goes_on_both_legs_as_it_sent_it(path: str) -> None:
    setup = Setup(prefill_policy="cache-aware", decode_policy="session")
    body: dict[str, Any] = (
        dict(FULL_CHAT, cache_salt="team-a")
        if path == routes.CHAT_COMPLETIONS
        else {"model": "m", "prompt": "hello", "cache_salt": "team-a"}
    )
    assert setup.post(path, body).answer().status == 200
    prefill, decode = setup.prefill.requests[-1].body, setup.decode.requests[-1].body
    assert prefill is not None and decode is not None
    assert prefill["cache_salt"] == decode["cache_salt"] == "team-a"
    assert setup.post(path, dict(body, cache_salt=None)).answer().status == 200  # (null: none)
