"""Per-tenant limits, by the clock: in flight, requests and tokens per minute."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest
from twisted.internet.task import Clock

from nixl_twisted.admission.limits import TenantLimits
from nixl_twisted.config import ConfigError, ProxyConfig, TenantRule
from nixl_twisted.protocol import salts
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.run import startup


def limits(**settings: object) -> tuple[TenantLimits, Clock]:
    clock = Clock()
    tenants = TenantLimits(clock)
    tenants.configure(ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"], **settings))
    return tenants, clock


def refused(tenants: TenantLimits, tenant: str, estimate: int = 0) -> ProxyError:
    with pytest.raises(ProxyError) as raised:
        tenants.admit(tenant, estimate)
    assert (raised.value.status, raised.value.code.value) == (429, "rate_limit_exceeded")
    return raised.value


def test_in_flight_is_per_tenant_and_given_back_when_a_request_ends() -> None:
    tenants, _ = limits(tenant_max_in_flight=2)
    first, _second = tenants.admit("a", 0), tenants.admit("a", 0)
    assert refused(tenants, "a").retry_after == 1.0
    tenants.admit("b", 0)  # another tenant is served
    first.release(None)
    tenants.admit("a", 0)


def test_requests_per_minute_slide_with_the_clock() -> None:
    tenants, clock = limits(tenant_requests_per_minute=2)
    tenants.admit("a", 0).release(None)
    clock.advance(30)
    tenants.admit("a", 0).release(None)
    error = refused(tenants, "a")
    assert error.retry_after == 30.0 and "2 requests per minute" in error.message
    clock.advance(30)  # the first left the window
    tenants.admit("a", 0)


def test_tokens_per_minute_count_what_vllm_reported_and_estimates_in_flight() -> None:
    tenants, clock = limits(tenant_tokens_per_minute=100)
    big = tenants.admit("a", 500)  # nothing used yet: let through whatever its estimate
    refused(tenants, "a", 10)  # its estimate counts while it runs
    big.release(60)  # vLLM said 60
    tenants.admit("a", 40).release(40)
    refused(tenants, "a", 1)
    clock.advance(60)
    tenants.admit("a", 99)


def test_a_tenants_own_limits_override_the_defaults() -> None:
    tenants, _ = limits(tenant_max_in_flight=1, tenants={"vip": {"max-in-flight": 3}, "free": {}})
    for _ in range(3):
        tenants.admit("vip", 0)
    refused(tenants, "vip")
    tenants.admit("free", 0)  # (a limit left out is the default's)
    refused(tenants, "free")
    tenants.admit(None, 0)  # no tenant: no tenant limit


def test_an_idle_tenant_is_forgotten() -> None:
    tenants, clock = limits(tenant_requests_per_minute=5)
    tenants.admit("once", 0).release(None)
    assert set(tenants._use) == {"once"}  # its request is in the window
    clock.advance(61)
    tenants.admit("other", 0)
    assert set(tenants._use) == {"other"}


def test_a_keys_file_keeps_a_hash_inside_a_key_and_skips_comments(tmp_path: object) -> None:
    from pathlib import Path

    from nixl_twisted.web.keys_file import read_keys

    keys = Path(str(tmp_path)) / "keys"
    keys.write_text("# the teams\nsk-ab#cd team-a  # paid\nsk-ef\n")
    assert read_keys(str(keys)) == {"sk-ab#cd": "team-a", "sk-ef": None}


def test_a_request_that_generates_nothing_is_not_held_to_tokens_nor_charged() -> None:
    tenants, _ = limits(tenant_tokens_per_minute=10, tenant_requests_per_minute=2)
    tenants.admit("a", 50).release(50)  # over its tokens for a minute
    refused(tenants, "a", 1)
    tenants.admit("a", None).release(None)  # (models, tokenize: counted as a request)
    assert tenants._use["a"].charged == 50
    error = refused(tenants, "a")  # ... and held to its requests per minute
    assert "2 requests per minute" in error.message


def test_the_tokens_in_the_window_are_a_running_total() -> None:
    tenants, clock = limits(tenant_tokens_per_minute=1000)
    tenants.admit("a", 10).release(30)
    clock.advance(30)
    tenants.admit("a", 10).release(40)
    assert tenants._use["a"].charged == 70
    clock.advance(31)  # the first left the window
    tenants.admit("a", 5)
    assert tenants._use["a"].charged == 40 and tenants._use["a"].estimated == 5


def test_a_tenants_priority_is_its_own_else_the_default_and_is_no_limit() -> None:
    tenants, _ = limits(
        tenant_priority=5, tenants={"vip": {"priority": -10}, "batch": {"max-in-flight": 1}}
    )
    assert [tenants.rule(name).priority for name in ("vip", "batch", "other")] == [-10, 5, 5]
    assert not tenants.limits("vip")  # a priority alone: nothing to count
    assert tenants.limits("batch")


def test_the_tenant_table_with_priorities_survives_the_workers_json() -> None:
    config = ProxyConfig.create(
        prefill=["http://p:1"],
        decode=["http://d:1"],
        tenants={
            "vip": {"priority": -3, "cache-salt": "v", "ttft-slo-ms": 500, "class": "gold"},
            "free": {"requests-per-minute": 2},
        },
    )
    assert config.tenants.table == (
        ("free", -1, 2, -1, None, None, None, None, None, None),
        ("vip", -1, -1, -1, -3, None, "v", 500, "gold", None),
    )
    assert ProxyConfig.from_json(config.to_json()).tenants == config.tenants


def test_a_tenants_table_takes_underscores_and_names_a_wrong_key() -> None:
    underscored, _ = limits(tenants={"vip": {"max_in_flight": 3, "tokens_per_minute": 9}})
    assert underscored.rule("vip") == TenantRule(max_in_flight=3, tokens_per_minute=9)
    for given, said in [
        (
            {"max_inflight": 3},
            "tenant 'vip': unknown key 'max_inflight'; did you mean 'max-in-flight'?",
        ),
        ({"max-in-flight": 1, "max_in_flight": 2}, "'max-in-flight' and 'max_in_flight' are one"),
        ({"requests_per_minute": -5}, "tenant 'vip': requests-per-minute must be 0 (no limit) or"),
        (3, "tenant 'vip': must be a table of max-in-flight, requests-per-minute, tokens-per-"),
    ]:
        with pytest.raises(ConfigError) as refused:
            limits(tenants={"vip": given})
        assert said in str(refused.value)


@pytest.mark.parametrize("priority", ["high", 1.5, True, 2**63])
def test_a_priority_is_a_64_bit_whole_number(priority: object) -> None:
    with pytest.raises(ConfigError, match="priority"):
        limits(tenants={"vip": {"priority": priority}})


@pytest.mark.parametrize(
    ("given_up", "said"),
    [
        (
            "Redis error: could not set dbid=0: ERR max number of clients reached",
            "SELECT 0 failed: ERR max number of clients reached",
        ),
        (
            "Redis error: could not auth: WRONGPASS invalid username-password pair",
            "AUTH failed: WRONGPASS invalid username-password pair",
        ),
        (
            "Redis error: could not set dbid=3: Not received Redis response in 1.0 seconds",
            "SELECT 3 got no answer within 1 s",
        ),
        ("Redis error: could not auth: Lost connection", "the connection closed during AUTH"),
        ("Redis error: something else", "something else"),
    ],
)
def test_why_txredisapi_gave_up_on_a_connection_is_said_in_words(given_up: str, said: str) -> None:
    from nixl_twisted.fleet.link import handshake_failure

    assert handshake_failure(given_up) == said


# -- a tenant's cache_salt -----------------------------------------------------------


def test_a_tenants_cache_salt_is_its_own_else_derived_from_its_name_with_the_secret(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "salt-secret"
    secret.write_bytes(b"a secret of sixteen bytes or more\n")
    tenants, _ = limits(tenants={"vip": {"cache-salt": "vip-salt"}})
    assert tenants.rule("vip").cache_salt == "vip-salt"
    assert tenants.rule("other").cache_salt is None  # no secret: no salt
    tenants, _ = limits(
        tenants={"vip": {"cache-salt": "vip-salt"}}, tenant_salt_secret_file=str(secret)
    )
    derived = {name: tenants.rule(name).cache_salt for name in ("a", "b", "vip")}
    assert derived["vip"] == "vip-salt"
    expected = hmac.new(b"a secret of sixteen bytes or more", b"a", hashlib.sha256).hexdigest()
    assert derived["a"] == expected and derived["b"] != expected and len(expected) == 64
    again, _ = limits(tenant_salt_secret_file=str(secret))  # another process, the same file
    assert again.rule("a").cache_salt == expected


def test_a_salt_secret_that_cannot_be_used_is_refused_at_start_and_kept_on_reload(
    tmp_path: Path,
) -> None:
    short, missing = tmp_path / "short", tmp_path / "missing"
    short.write_bytes(b"too short\n")
    for path, said in [(short, "16 to 4096 bytes, not 9"), (missing, "cannot be read")]:
        config = ProxyConfig.create(
            prefill=["http://p:1"], decode=["http://d:1"], tenant_salt_secret_file=str(path)
        )
        with pytest.raises(SystemExit, match=said):
            startup.check_salt_secret(config)
    good = tmp_path / "good"
    good.write_bytes(b"x" * 32)
    tenants, _ = limits(tenant_salt_secret_file=str(good))
    before = tenants.rule("a").cache_salt
    tenants.configure(
        ProxyConfig.create(
            prefill=["http://p:1"], decode=["http://d:1"], tenant_salt_secret_file=str(missing)
        )
    )
    assert before is not None and tenants.rule("a").cache_salt == before


@pytest.mark.parametrize("salt", ["", "a/b", "a@b", "s" * 129, 7])
def test_a_cache_salt_vllm_would_refuse_is_a_config_error(salt: object) -> None:
    with pytest.raises(ConfigError, match="tenant 'vip': cache-salt must be"):
        ProxyConfig.create(
            prefill=["http://p:1"], decode=["http://d:1"], tenants={"vip": {"cache-salt": salt}}
        )


def test_a_tenants_salt_is_combined_with_a_clients_never_replaced_by_it() -> None:
    assert salts.combined("t", None) == "t"
    mixed = salts.combined("t", "c")
    assert len(mixed) == 64 and mixed not in ("t", "c")
    assert mixed != salts.combined("u", "c") and mixed != salts.combined("t", "d")
