"""/metrics after real requests, and the one access-log event per request."""

from __future__ import annotations

import json
from typing import Any

from twisted.logger import formatEvent

from nixl_twisted.observe.access import access_line
from tests.memory.support import FULL_CHAT, Setup


def test_counters_histograms_and_gauges_move_with_real_requests() -> None:
    setup = Setup(prefills=2, unhealthy_threshold=1)
    p0, p1 = (p.url for p in setup.prefills)
    decode = setup.decode.url
    for _ in range(2):
        setup.post("/v1/chat/completions", FULL_CHAT).answer()
    setup.prefills[0].crash_next(502)  # retried on prefill-1
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200
    for prefill in setup.prefills:  # (prefill-0 is down now: tried last, a bad handoff too)
        prefill.omit_kv_transfer_params_next()
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 502
    setup.post("/v1/completions", b"[]").answer()

    # One stream held open, then left by its client.
    client = setup.held_stream()
    during = setup.scrape()
    client.disconnect()
    assert setup.decode.disconnects == 1
    setup.decode.release()
    setup.proxy.flush()

    m = setup.scrape()

    def value(name: str, **labels: str) -> float:
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    assert during[("nixlproxy_requests_in_flight", ())] == 1
    assert value("nixlproxy_requests_in_flight") == 0
    chat = "/v1/chat/completions"
    assert value("nixlproxy_requests_total", route=chat, status="200", model="") == 3
    assert value("nixlproxy_requests_total", route=chat, status="502", model="") == 1
    assert value("nixlproxy_requests_total", route=chat, status="client_left", model="") == 1
    assert value("nixlproxy_requests_total", route="/v1/completions", status="400", model="") == 1

    def legs(pool: str, instance: str, outcome: str) -> float:
        return value(
            "nixlproxy_backend_requests_total", pool=pool, instance=instance, outcome=outcome
        )

    assert legs("prefill", p0, "answered") == 1
    assert legs("prefill", p0, "error_status") == 1
    assert legs("prefill", p1, "answered") == 3
    assert legs("prefill", p1, "bad_handoff") == 1
    assert legs("prefill", p0, "bad_handoff") == 1
    assert legs("decode", decode, "answered") == 4
    # The 502's, and the bad handoff's two (the second found no instance left to try).
    assert value("nixlproxy_retries_total", pool="prefill") == 3
    assert value("nixlproxy_prefill_missing_kv_transfer_params_total") == 2
    assert value("nixlproxy_prefill_bad_handoffs_total", instance=p1, problem="missing") == 1
    assert value("nixlproxy_client_disconnects_total", phase="relay") == 1
    # Each leg's latency by the instance that answered with params.
    assert value("nixlproxy_prefill_seconds_count", instance=p0) == 1
    assert value("nixlproxy_prefill_seconds_count", instance=p1) == 3
    assert value("nixlproxy_decode_first_byte_seconds_count", instance=decode) == 4
    assert not [key for key in m if key[0].endswith("_created")]
    # Every completion that got an answer: three 200s, the 502 and the 400.
    assert value("nixlproxy_request_seconds_count") == 5
    # prefill-0 answered 502: it is out of rotation, and the gauge says so.
    assert value("nixlproxy_backend_healthy", pool="prefill", instance=p0) == 0
    assert value("nixlproxy_backend_healthy", pool="decode", instance=decode) == 1
    # No request id, no prompt, ever, as a label.
    labels = {v for key in m for _, v in key[1]}
    for request in setup.decode.requests:
        assert request.request_id not in labels
    assert not any("hello there" in label for label in labels)


def test_the_client_ttfb_and_handoff_gap_are_observed_per_route() -> None:
    setup = Setup(tokens=3)
    setup.post("/v1/chat/completions", dict(FULL_CHAT, stream=True)).answer()
    setup.post("/v1/completions", {"model": "m", "prompt": "x"}).answer()
    m = setup.scrape()
    for route in ("/v1/chat/completions", "/v1/completions"):
        key = ("nixlproxy_time_to_first_byte_seconds_count", (("model", ""), ("route", route)))
        assert m[key] == 1
    assert m[("nixlproxy_handoff_gap_seconds_count", ())] == 2
    assert m.get(("nixlproxy_handoff_gap_over_warning_total", ()), 0) == 0


# -- the access log --------------------------------------------------------------


def test_one_event_per_request_with_both_legs(access_events: list[dict[str, Any]]) -> None:
    setup = Setup()
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()
    setup.post("/v1/chat/completions", b"{").answer()
    setup.get("/healthcheck").answer()

    assert len(access_events) == 3
    first, second, third = access_events
    (request_id,) = answer.values("x-request-id")
    assert first["request_id"] == request_id
    assert first["path"] == "/v1/chat/completions"
    assert first["method"] == "POST"
    assert first["status"] == 200
    assert first["prefill"] == setup.prefill.url
    assert first["decode"] == setup.decode.url
    assert (first["prefill_status"], first["decode_status"]) == (200, 200)
    assert isinstance(first["prefill_ms"], int)
    assert isinstance(first["decode_ttfb_ms"], int)
    assert first["bytes"] == len(answer.body)
    assert "ended" not in first  # answered: the usual ending is not said
    assert first["client"].startswith("127.0.0.1:")
    assert second["status"] == 400
    assert "prefill" not in second  # what did not happen is left out
    assert third["path"] == "/healthcheck"
    json.dumps(access_events)


def test_access_log_off_emits_no_event_and_still_counts(
    access_events: list[dict[str, Any]],
) -> None:
    setup = Setup(access_log="off")
    for _ in range(2):
        assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200
    samples = setup.scrape()
    assert access_events == []
    key = (
        "nixlproxy_requests_total",
        (("model", ""), ("route", "/v1/chat/completions"), ("status", "200")),
    )
    assert samples[key] == 2


def test_a_client_that_leaves_gets_its_event_too(access_events: list[dict[str, Any]]) -> None:
    setup = Setup()
    client = setup.held_stream()
    client.disconnect()
    setup.decode.release()
    setup.proxy.flush()
    (event,) = access_events
    assert event["ended"] == "client_left"
    assert event["decode"] == setup.decode.url


def test_a_404_keeps_its_path_bounded(access_events: list[dict[str, Any]]) -> None:
    setup = Setup()
    setup.post("/v2/" + "x" * 300, FULL_CHAT).answer()
    (event,) = access_events
    assert event["status"] == 404
    assert event["path"] == "/v2/" + "x" * 196 + "..."


def test_the_model_and_the_usage_decode_reported(access_events: list[dict[str, Any]]) -> None:
    setup = Setup()
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer().json()
    setup.post(
        "/v1/completions",
        {
            "model": "m\ud800",
            "prompt": "one two three",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ).answer()
    whole, streamed = access_events
    usage = answer["usage"]
    assert whole["model"] == "fake-model"
    assert (whole["prompt_tokens"], whole["completion_tokens"], whole["cached_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )
    assert streamed["model"] == "m\\ud800"  # a lone surrogate, escaped
    assert streamed["prompt_tokens"] == 3
    assert "tokens=(" in access_line(streamed)


def test_every_attempt_of_each_leg_is_listed(access_events: list[dict[str, Any]]) -> None:
    setup = Setup(prefills=2, decodes=1, decode_retries=1)
    dead = "http://decode-dead.memory"  # no fake serves it: the connection is refused
    setup.proxy.service.backends.decode.add(dead)
    setup.proxy.service.backends.decode.instances.reverse()  # the dead one first
    setup.prefills[0].crash_next(503)
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200
    (event,) = access_events
    p0, p1 = (fake.url for fake in setup.prefills)
    assert event["attempts"] == [
        f"prefill {p0} full",
        f"prefill {p1} answered",
        f"decode {dead} unreachable",
        f"decode {setup.decode.url} answered",
    ]
    assert f"attempts=[prefill {p0} full; " in access_line(event)


def test_a_batch_lists_each_parts_legs_and_sums_their_usage(
    access_events: list[dict[str, Any]],
) -> None:
    setup = Setup()
    body = {"model": "m", "prompt": ["one", "two three"], "max_tokens": 2}
    answer = setup.post("/v1/completions", body).answer()
    assert answer.status == 200
    (event,) = access_events
    assert len(event["parts"]) == 2
    for index, part in enumerate(event["parts"]):
        assert part.startswith(f"{index}: "), part
        assert f"prefill={setup.prefill.url} (200)" in part
        assert f"decode={setup.decode.url} (200)" in part
    assert event["prompt_tokens"] == answer.json()["usage"]["prompt_tokens"]
    assert event["completion_tokens"] == 4


def test_a_decode_break_is_not_told_as_the_client_leaving(
    logged: list[dict[str, Any]], access_events: list[dict[str, Any]]
) -> None:
    setup = Setup(decode_migrations=0)
    setup.decode.break_next(after_events=2)
    client = setup.post("/v1/chat/completions", dict(FULL_CHAT, stream=True))
    # The proxy closes the connection (its event written as it does).
    assert not client.answer().complete and client.lost
    lines = [formatEvent(e) for e in logged]
    assert any("broke off" in line for line in lines), lines
    assert not any("client left" in line for line in lines), lines
    (event,) = access_events
    assert event["ended"] == "broken"
    samples = setup.scrape()
    assert ("nixlproxy_client_disconnects_total", (("phase", "relay"),)) not in samples
