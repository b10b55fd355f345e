"""A request's first-token target: its headers, their order, and what a value must be."""

from __future__ import annotations

import pytest
from twisted.web.http_headers import Headers

from nixl_twisted.config import ConfigError, ProxyConfig
from nixl_twisted.config.tenants import TenantRow, TenantRule, tenant_table
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import read_completion
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import backend_request_headers
from nixl_twisted.protocol.targets import (
    MAX_TTFT_MS,
    TTFT_HEADERS,
    Target,
    kept_as,
    ttft_target,
)


def sent(**headers: str | list[str]) -> Headers:
    table = Headers()
    for name, value in headers.items():
        values = value if isinstance(value, list) else [value]
        table.setRawHeaders(name.replace("_", "-"), values)
    return table


def test_each_header_names_a_target_and_the_first_present_wins() -> None:
    assert ttft_target(sent()) is None
    assert ttft_target(sent(x_slo_ttft_ms="1500")) == Target(1500, "x-slo-ttft-ms")
    assert ttft_target(sent(x_llm_d_slo_ttft_ms="20")) == Target(20, "x-llm-d-slo-ttft-ms")
    assert ttft_target(sent(x_dynamo_meta_slo_ttft_ms="3")) == Target(
        3, "x-dynamo-meta-slo-ttft-ms"
    )
    assert ttft_target(sent(x_dynamo_slo_ttft_ms="4")) == Target(4, "x-dynamo-slo-ttft-ms")
    every = sent(
        x_dynamo_slo_ttft_ms="4",
        x_dynamo_meta_slo_ttft_ms="3",
        x_llm_d_slo_ttft_ms="2",
        x_slo_ttft_ms="1",
    )
    assert ttft_target(every) == Target(1, "x-slo-ttft-ms")
    every.removeHeader(b"x-slo-ttft-ms")
    assert ttft_target(every) == Target(2, "x-llm-d-slo-ttft-ms")
    every.removeHeader(b"X-LLM-D-SLO-TTFT-MS")
    assert ttft_target(every) == Target(3, "x-dynamo-meta-slo-ttft-ms")
    assert ttft_target(sent(x_slo_ttft_ms=["7", "7"])) == Target(7, "x-slo-ttft-ms")
    assert ttft_target(sent(x_slo_ttft_ms=str(MAX_TTFT_MS))) == Target(MAX_TTFT_MS, "x-slo-ttft-ms")


@pytest.mark.parametrize(
    "value", ["0", "-5", "+5", "1.5", "1e3", "", "abc", "3600001", "99999999999", "0x10", "1 2"]
)
@pytest.mark.parametrize("name", [name.decode() for name in TTFT_HEADERS])
def test_a_value_that_is_not_whole_ms_in_bounds_is_a_400_naming_its_header(
    name: str, value: str
) -> None:
    with pytest.raises(ProxyError) as raised:
        ttft_target(Headers({name.upper(): [value]}))
    assert raised.value.code is ErrorCode.INVALID_TTFT_TARGET
    assert raised.value.status == 400
    assert raised.value.code.error_type == "invalid_request_error"
    assert name in raised.value.message


def test_one_header_sent_twice_with_different_values_is_refused() -> None:
    with pytest.raises(ProxyError, match="x-llm-d-slo-ttft-ms more than once"):
        ttft_target(sent(x_llm_d_slo_ttft_ms=["10", "20"]))


def test_the_target_headers_never_reach_a_leg() -> None:
    client = Headers({name: [b"100"] for name in TTFT_HEADERS})
    leg = backend_request_headers(client, "r-1", None, forwarded=("X-Team",))
    assert not {name.lower() for name, _ in leg.getAllRawHeaders()} & set(TTFT_HEADERS)


def test_a_tenant_s_target_is_used_only_when_the_request_names_none() -> None:
    rule = TenantRule(ttft_slo_ms=800, tenant_class="gold")
    plain = read_completion(b'{"model": "m", "prompt": "x"}', "/v1/completions", "r", 8)
    assert plain.ttft_target is None
    assert plain.admitted("a", rule).ttft_target == Target(800, "tenant")
    assert plain.admitted("a", TenantRule()).ttft_target is None
    named = read_completion(
        b'{"model": "m", "prompt": "x"}', "/v1/completions", "r", 8, target=Target(50, "h")
    )
    assert named.admitted("a", rule).ttft_target == Target(50, "h")
    batch = read_completion(
        b'{"model": "m", "prompt": ["x", "y"]}', "/v1/completions", "r", 8, target=Target(5, "h")
    )
    assert [part.ttft_target for part in batch.parts()] == [Target(5, "h")] * 2


def test_a_tenant_s_target_and_class_are_read_and_checked() -> None:
    (row,) = tenant_table({"a": {"ttft-slo-ms": 900, "class": "gold", "priority": 2}})
    assert (row.ttft_slo_ms, row.tenant_class) == (900, "gold")
    assert tenant_table(tenant_table({"a": {"ttft-slo-ms": 900}})) == tenant_table(
        {"a": {"ttft-slo-ms": 900}}
    )
    rule = TenantRule(priority=1).under(row)
    assert (rule.ttft_slo_ms, rule.outcome_class) == (900, "gold")
    bare = TenantRule(priority=1).under(TenantRow("b"))
    assert (bare.ttft_slo_ms, bare.outcome_class) == (None, "priority-1")
    assert TenantRule().outcome_class == "default"
    for bad, message in (
        ({"ttft-slo-ms": 0}, "ttft-slo-ms must be above 0"),
        ({"ttft-slo-ms": 3_600_001}, "ttft-slo-ms must be above 0"),
        ({"ttft-slo-ms": 1.5}, "ttft-slo-ms"),
        ({"class": "team a"}, "class must be"),
        ({"class": "x" * 33}, "class must be"),
    ):
        with pytest.raises(ConfigError, match=message):
            ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"], tenants={"a": bad})


def test_the_door_looks_each_header_up_as_twisted_keeps_it() -> None:
    for name in TTFT_HEADERS:
        assert kept_as(name) in sent(**{name.decode().upper(): "1"})._rawHeaders


def test_a_tenant_says_whether_a_request_predicted_to_miss_is_refused_or_served_late() -> None:
    rows = tenant_table({"late-ok": {"ttft-miss": "serve"}, "plain": {}})
    rules = {row.name: TenantRule().under(row) for row in rows}
    assert (rules["late-ok"].ttft_miss, rules["plain"].ttft_miss) == ("serve", "refuse")
    assert TenantRule().ttft_miss == "refuse"  # (no tenant)
    assert tenant_table(rows) == rows  # (the workers' JSON)
    with pytest.raises(ConfigError, match="ttft-miss must be one of refuse, serve"):
        ProxyConfig.create(
            prefill=["http://p:1"], decode=["http://d:1"], tenants={"a": {"ttft-miss": "later"}}
        )
