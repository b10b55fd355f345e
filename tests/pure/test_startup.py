"""What a starting proxy says and checks: the summary line, the descriptor limit."""

from __future__ import annotations

import resource
from dataclasses import replace
from pathlib import Path

import pytest
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from zope.interface import provider

from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.models import model_table
from nixl_twisted.run import startup

CONFIG = ProxyConfig.create(
    prefill=["http://p:1", "http://p:2"],
    decode=["http://d:1"],
    decode_policy="session",
    max_in_flight=100,
    max_connections=200,
)


def test_the_summary_names_the_pools_policies_and_limits() -> None:
    line = startup.summary(CONFIG)
    assert "prefill http://p:1, http://p:2 (round-robin); decode http://d:1 (session)" in line
    assert "max-in-flight 100, max-connections 200" in line
    assert "health checks every 3 s; two legs always" in line
    assert "models" not in line


def test_the_summary_names_each_models_table() -> None:
    table = {"qwen": {"decode": ["http://q:1", "http://q:2"], "decode-policy": "session"}}
    line = startup.summary(replace(CONFIG, pools=replace(CONFIG.pools, models=model_table(table))))
    assert "; models: qwen (0 prefill, 2 decode; decode-policy session); caps " in line


def test_the_summary_names_what_limits_requests_and_never_a_key_nor_a_password(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-file-1 team-a\nsk-file-2\nsk-given\n")
    config = ProxyConfig.create(
        prefill=["http://p:1"],
        decode=["http://d:1"],
        prefill_max_in_flight=8,
        decode_max_in_flight=4,
        queue_size=64,
        queue_timeout=5,
        api_key=["sk-given", "sk-other"],
        api_keys_file=str(keys),
        tenant_header="X-Tenant",
        tenant_max_in_flight=3,
        tenant_tokens_per_minute=1000,
        tenants={"team-a": {"max-in-flight": 2}},
        replicas_redis="redis://:hunter2@redis.serving:6379/1",
        limits_redis="rediss://user:hunter3@limits:6380/0",
    )
    line = startup.summary(config)
    assert line.endswith(
        "; caps prefill 8, decode 4 per instance; queue 64, 5 s at most; "
        "tenants by X-Tenant, each 3 in flight, 1000 tokens/min, [tenants] lists 1; "
        f"client keys: 4, --api-keys-file {keys}; "
        "Redis: replicas redis://redis.serving:6379/1, tenant limits rediss://limits:6380/0"
    ), line
    assert "hunter" not in line and "sk-" not in line
    alone = startup.summary(CONFIG)
    assert alone.endswith(
        "; caps prefill none, decode none per instance; no queue; tenants: none; "
        "client keys: none (anyone is served); Redis: none (this replica alone)"
    ), alone


class FakeLimits:
    def __init__(self, soft: int, hard: int) -> None:
        self.limits = (soft, hard)

    def get(self, which: int) -> tuple[int, int]:
        return self.limits

    def set(self, which: int, limits: tuple[int, int]) -> None:
        self.limits = limits


@pytest.mark.parametrize(
    ("soft", "hard", "after"),
    [
        (1024, 4096, 1024),  # already enough: 200 + 2 * 100 + 64 = 464
        (256, 4096, 464),  # raised to what is needed
        (256, 300, 300),  # raised to the hard limit, still short: warned
    ],
)
def test_the_soft_descriptor_limit_is_raised_toward_what_the_limits_need(
    monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, after: int
) -> None:
    fake = FakeLimits(soft, hard)
    monkeypatch.setattr(resource, "getrlimit", fake.get)
    monkeypatch.setattr(resource, "setrlimit", fake.set)
    before, raised = startup.check_descriptors(CONFIG)
    assert (before, raised) == (soft, after)
    assert fake.limits == (after, hard)


@pytest.mark.parametrize(
    ("settings", "warned"),
    [
        ({"tenant_max_in_flight": 2}, True),
        ({"tenants": {"team-a": {"tokens-per-minute": 10}}}, True),
        ({"tenants": {"team-a": {}}}, False),  # (no limit of its own, none by default)
        ({"tenant_max_in_flight": 2, "tenant_header": "x-team"}, False),
        ({"tenant_max_in_flight": 2, "api_key": ["sk-a"]}, False),
    ],
)
def test_tenant_limits_that_no_request_can_have_are_warned_of(
    settings: dict[str, object], warned: bool
) -> None:
    warnings = [line for line in warnings_at_start(settings) if "tenant" in line]
    assert len(warnings) == (1 if warned else 0)


@pytest.mark.parametrize(
    ("settings", "warned"),
    [
        ({"api_key": ["sk-a"]}, True),
        ({"api_key": ["sk-a"], "admin_token": "t"}, False),
        ({"api_key": ["sk-a"], "metrics_listen": "tcp:9100"}, False),
        ({"api_key": ["sk-a"], "admin_listen": "tcp:9000"}, False),
        ({}, False),  # (every client served: the fleet is shown to anyone, warned of apart)
    ],
)
def test_keys_with_metrics_nobody_can_read_are_warned_of(
    settings: dict[str, object], warned: bool
) -> None:
    said = [line for line in warnings_at_start(settings) if "/metrics to nobody" in line]
    assert said == (
        [
            "clients need a key and there is no --admin-token: the --listen endpoints answer "
            "/metrics to nobody and /healthcheck with readiness alone; serve them on "
            "--metrics-listen or --admin-listen, or set an admin token (docs/security.md)"
        ]
        if warned
        else []
    )


def warnings_at_start(settings: dict[str, object]) -> list[str]:
    """The warnings ``startup.announce`` logs for a proxy with ``settings``."""
    events: list[dict[str, object]] = []

    @provider(ILogObserver)
    def observer(event: dict[str, object]) -> None:
        events.append(event)

    globalLogPublisher.addObserver(observer)
    try:
        startup.announce(
            ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"], **settings)
        )
    finally:
        globalLogPublisher.removeObserver(observer)
    return [formatEvent(e) for e in events if e["log_level"] == LogLevel.warn]
