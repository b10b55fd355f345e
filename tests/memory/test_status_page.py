"""The status page: its JSON, the page rendered on the server, who may see them, and the
charts sampled once a second only while someone looks (``docs/status-page.md``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.logger import Logger

from nixl_twisted.observe.history import LOOKED_AT
from tests.memory.support import FULL_CHAT, Setup

TOKEN = "admin-secret-token"
SCRIPTED = '<script>alert("x")</script>&model'
PAGES = ("/", "/status.json", "/status.js", "/status.css")


@pytest.fixture
def setup() -> Iterator[Setup]:
    """Two decodes, one of them serving a model whose name is markup; the page's parts running."""
    made = Setup(decodes=2, health_interval=1.0, start=False)
    made.decodes[1].model = SCRIPTED
    made.proxy.start()  # (the first round of checks: what each instance serves)
    made.proxy.app.status.history.startService()
    made.proxy.app.status.warnings.startService()
    yield made
    made.proxy.app.status.history.stopService()
    made.proxy.app.status.warnings.stopService()


def status(setup: Setup) -> Any:
    answer = setup.get("/status.json").answer()
    assert answer.status == 200
    assert answer.values("Content-Type") == ["application/json"]
    return answer.json()


def test_the_json_shows_every_instance_by_model_with_its_state(setup: Setup) -> None:
    said = status(setup)
    assert said["status_version"] == 1
    assert said["proxy"]["ready"] is True and said["proxy"]["worker"] is None
    by_model = {m["model"]: m for m in said["models"]}
    assert by_model["fake-model"]["decode"] == [setup.decodes[0].url]
    assert by_model[SCRIPTED]["decode"] == [setup.decodes[1].url]
    decode = {i["url"]: i for i in said["instances"]["decode"]}
    assert decode[setup.decodes[1].url]["state"] == "up"
    assert set(said) >= {"models", "instances", "sources", "queues", "tenants", "history"}
    assert said["warnings"] == []


def test_the_page_is_rendered_with_every_datum_escaped_and_a_strict_policy(setup: Setup) -> None:
    answer = setup.get("/").answer()
    assert answer.status == 200
    assert answer.values("Content-Type") == ["text/html; charset=utf-8"]
    (policy,) = answer.values("Content-Security-Policy")
    assert "script-src 'self'" in policy and "style-src 'self'" in policy
    assert "default-src 'none'" in policy
    page = answer.body.decode()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;model" in page
    assert "<script>alert" not in page
    # One script, one style sheet, both the proxy's own, an empty icon; nothing else is loaded.
    assert re.findall(r'(?:src|href)="([^"]*)"', page) == ["data:,", "/status.css", "/status.js"]
    rows = re.findall(
        r'<tr class="instance state-(\w+)" data-pool="(\w+)" data-url="([^"]+)"', page
    )
    assert sorted(rows) == sorted(
        [("up", "prefill", setup.prefill.url)]
        + [("up", "decode", fake.url) for fake in setup.decodes]
    )


def test_the_script_and_style_are_served_from_the_package(setup: Setup) -> None:
    script = setup.get("/status.js").answer()
    assert script.values("Content-Type") == ["text/javascript; charset=utf-8"]
    assert b"textContent" in script.body and b"innerHTML" not in script.body
    style = setup.get("/status.css").answer()
    assert style.values("Content-Type") == ["text/css; charset=utf-8"]
    assert b"@import" not in style.body and b"url(" not in style.body


def test_an_instance_down_shows_down_with_its_error(setup: Setup) -> None:
    setup.decodes[1].health_status = 503
    for _ in range(setup.proxy.service.config.health.unhealthy_threshold):
        setup.settle(setup.proxy.service.checks.check_health())
    decode = {i["url"]: i for i in status(setup)["instances"]["decode"]}
    assert decode[setup.decodes[1].url]["state"] == "down"
    assert decode[setup.decodes[1].url]["last_error"]
    page = setup.get("/").answer().body.decode()
    assert (
        f'class="instance state-down" data-pool="decode" data-url="{setup.decodes[1].url}"' in page
    )


def test_the_full_healthcheck_is_what_the_page_reads(setup: Setup) -> None:
    health = setup.get("/healthcheck").answer().json()
    said = status(setup)
    assert health["instances"] == said["instances"]
    assert health["pid"] == said["proxy"]["pid"]


# -- who may see it ---------------------------------------------------------------


def test_with_an_admin_endpoint_the_client_endpoint_has_no_status_page() -> None:
    setup = Setup(admin_listen="tcp:0:interface=127.0.0.1")
    for path in PAGES:
        answer = setup.get(path).answer()
        assert answer.status == 404, path
        assert setup.decode.url.encode() not in answer.body


def test_while_clients_need_a_key_the_page_needs_the_admin_token() -> None:
    setup = Setup(api_key=["sk-client"], admin_token=TOKEN)
    for path in PAGES:
        for headers in (None, {"Authorization": "Bearer sk-client"}):
            answer = setup.get(path, headers).answer()
            assert answer.status == 401, path
            assert setup.decode.url.encode() not in answer.body
        admin = setup.get(path, {"Authorization": f"Bearer {TOKEN}"}).answer()
        assert admin.status == 200, path


def test_the_page_is_read_only() -> None:
    setup = Setup()
    for path in PAGES:
        assert setup.post(path, {}).answer().status == 405


# -- the last minutes ---------------------------------------------------------------


def test_nothing_is_sampled_until_the_page_is_asked_for(setup: Setup) -> None:
    history = setup.proxy.app.status.history
    setup.proxy.advance(30)
    assert not history.sampling
    assert status(setup)["history"]["points"] == []
    assert history.sampling


def test_the_charts_count_completions_per_second_and_their_first_token_time(
    setup: Setup,
) -> None:
    status(setup)  # (sampling starts)
    for _ in range(3):
        assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200
    setup.proxy.advance(1)
    point = status(setup)["history"]["points"][-1]
    assert point["requests_per_second"] == 3.0  # (the page's own requests are not counted)
    assert point["first_token_p50"] is not None and point["first_token_p99"] is not None
    assert point["decode_only"] == {}  # (every one took its prefill leg)
    assert point["prefix_hit_rate"] == {}  # (round-robin looks for no cached prefix)
    setup.proxy.advance(1)
    assert status(setup)["history"]["points"][-1]["requests_per_second"] == 0.0


def test_sampling_stops_a_minute_after_the_last_look_and_forgets(setup: Setup) -> None:
    history = setup.proxy.app.status.history
    status(setup)
    for _ in range(int(LOOKED_AT)):  # (a second at a time, as the reactor's clock goes)
        setup.proxy.advance(1)
    assert history.sampling
    assert len(history.points()) == LOOKED_AT
    setup.proxy.advance(1)
    assert not history.sampling
    assert history.points() == []


def test_refusals_are_charted_by_reason(setup: Setup) -> None:
    status(setup)
    answer = setup.post("/v1/chat/completions", dict(FULL_CHAT, model="nobody")).answer()
    assert answer.status == 404
    setup.proxy.advance(1)
    point = status(setup)["history"]["points"][-1]
    assert point["requests_per_second"] == 1.0
    assert point["refused_per_second"] == {}  # (a 404 is not a refusal of load)


def test_first_token_outcomes_are_charted_and_summed_by_tenant_class(setup: Setup) -> None:
    status(setup)
    within = {"x-slo-ttft-ms": "3600000"}
    assert setup.post("/v1/chat/completions", FULL_CHAT, within).answer().status == 200
    assert setup.post("/v1/chat/completions", FULL_CHAT, within).answer().status == 200
    assert setup.post("/v1/chat/completions", b"{", within).answer().status == 400
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200  # (no target)
    setup.proxy.advance(1)
    said = status(setup)
    point = said["history"]["points"][-1]
    assert point["ttft_outcomes"] == {"default": {"on_time": 2, "refused": 1}}
    assert point["ttft_on_time"] == {"default": 0.6667}
    assert said["ttft_last_minute"] == {"default": {"on_time": 2, "refused": 1}}
    for _ in range(61):
        setup.proxy.advance(1)
        status(setup)
    assert status(setup)["ttft_last_minute"] == {}  # (a minute on, nothing new)


# -- tenants and warnings -----------------------------------------------------------------


def test_tenants_show_their_use_against_their_limits_and_refusals() -> None:
    setup = Setup(tenant_header="x-team", tenant_requests_per_minute=1)
    team = {"x-team": "<b>team</b>"}
    assert setup.post("/v1/chat/completions", FULL_CHAT, team).answer().status == 200
    assert setup.post("/v1/chat/completions", FULL_CHAT, team).answer().status == 429
    (tenant,) = status(setup)["tenants"]
    assert tenant == {
        "tenant": "<b>team</b>",
        "in_flight": 0,
        "max_in_flight": 0,
        "requests_last_minute": 1,
        "requests_per_minute": 1,
        "tokens_last_minute": None,
        "tokens_per_minute": 0,
        "refused_last_minute": 1,
    }
    page = setup.get("/").answer().body.decode()
    assert "&lt;b&gt;team&lt;/b&gt;" in page and "<b>team" not in page
    setup.proxy.advance(61)
    assert status(setup)["tenants"] == []


def test_recent_warnings_are_the_log_lines_newest_first(setup: Setup) -> None:
    log = Logger(namespace="nixlproxy.test")
    log.info("not a warning")
    log.warn("first {what}", what="<img src=x>")
    log.error("second")
    said = status(setup)["warnings"]
    assert [w["level"] for w in said] == ["error", "warn"]
    assert said[0]["line"].endswith("[nixlproxy.test#error] second")
    assert said[1]["line"].endswith("first <img src=x>")
    page = setup.get("/").answer().body.decode()
    assert "first &lt;img src=x&gt;" in page and "<img src=x>" not in page


def test_the_prefix_hit_rate_is_charted_by_policy() -> None:
    setup = Setup(prefills=2, prefill_policy="cache-aware")
    status(setup)
    setup.proxy.app.status.history.startService()
    try:
        status(setup)
        long = dict(FULL_CHAT, messages=[{"role": "user", "content": "why? " * 200}])
        for _ in range(4):  # the first finds no prefix; the other three find it
            assert setup.post("/v1/chat/completions", long).answer().status == 200
        setup.proxy.advance(1)
        point = status(setup)["history"]["points"][-1]
    finally:
        setup.proxy.app.status.history.stopService()
    assert point["prefix_hit_rate"] == {"cache-aware": 0.75}
