"""``cache_salt``: checked at the door as vLLM checks it, carried on both legs, a tenant's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nixl_twisted.protocol import routes, salts
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


def legs_salts(setup: Setup) -> tuple[object, object]:
    prefill, decode = setup.prefill.requests[-1].body, setup.decode.requests[-1].body
    assert prefill is not None and decode is not None
    return prefill.get("cache_salt"), decode.get("cache_salt")


def test_a_tenants_salt_goes_on_both_legs_combined_with_a_clients_own(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"sixteen bytes and then some")
    setup = Setup(
        prefill_policy="kv-aware",
        tenant_header="x-team",
        tenants={"vip": {"cache-salt": "vip-salt"}},
        tenant_salt_secret_file=str(secret),
    )
    for path in (routes.CHAT_COMPLETIONS, routes.MESSAGES, routes.RESPONSES):
        body = FULL_CHAT if path != routes.RESPONSES else {"model": "m", "input": "hi"}
        if path == routes.MESSAGES:
            body = dict(FULL_CHAT, max_tokens=4)
        assert setup.post(path, body, {"x-team": "vip"}).answer().status == 200
        assert legs_salts(setup) == ("vip-salt", "vip-salt")
    chat = routes.CHAT_COMPLETIONS
    assert setup.post(chat, FULL_CHAT, {"x-team": "team-a"}).answer().status == 200
    derived = salts.derived(b"sixteen bytes and then some", "team-a")
    assert legs_salts(setup) == (derived, derived)
    own = dict(FULL_CHAT, cache_salt="mine")
    assert setup.post(chat, own, {"x-team": "team-a"}).answer().status == 200
    combined = salts.combined(derived, "mine")
    assert legs_salts(setup) == (combined, combined)
    # Another tenant's client that sends team-a's salt as its own gets a namespace of its own.
    stolen = dict(FULL_CHAT, cache_salt=derived)
    assert setup.post(chat, stolen, {"x-team": "team-b"}).answer().status == 200
    assert derived not in legs_salts(setup)
    assert setup.post(chat, own).answer().status == 200  # no tenant: the client's, as sent
    assert legs_salts(setup) == ("mine", "mine")
