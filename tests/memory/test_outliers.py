"""Outlier ejection in memory: a decode or prefill that answers every leg with 500 leaves
rotation a while, said once, counted, shown; the requests go to the other instance."""

from __future__ import annotations

import json
from typing import Any

from twisted.logger import formatEvent

from tests.memory.support import FULL_CHAT, Setup


def completion(setup: Setup) -> int:
    return setup.post("/v1/chat/completions", FULL_CHAT).answer().status


def ejections(logged: list[dict[str, Any]]) -> list[str]:
    return [formatEvent(e) for e in logged if "ejected for" in e.get("log_format", "")]


def test_a_decode_whose_kv_loads_fail_is_ejected_and_the_other_serves(
    logged: list[dict[str, Any]],
) -> None:
    setup = Setup(decodes=2)  # (the defaults: 5 failures in a row, 30 s)
    bad = setup.decodes[1]
    for _ in range(20):
        bad.crash_next(500, "KV load failed: the blocks were freed")
    codes = [completion(setup) for _ in range(20)]
    # Round robin: every other request reached it until its fifth 500 ejected it.
    assert codes.count(500) == 5
    assert codes[10:] == [200] * 10
    assert len(bad.requests) == 5
    said = ejections(logged)
    assert len(said) == 1
    assert bad.url in said[0] and "30 s" in said[0] and "HTTP 500" in said[0]
    assert all(e["log_level"].name == "warn" for e in logged if "ejected for" in e["log_format"])

    samples = setup.scrape()
    labels = (("instance", bad.url), ("pool", "decode"))
    assert samples[("nixlproxy_outlier_ejections_total", labels)] == 1
    assert samples[("nixlproxy_backend_ejected", labels)] == 1
    health = json.loads(setup.get("/healthcheck").answer().body)
    shown = {i["url"]: i for i in health["instances"]["decode"]}
    assert shown[bad.url]["ejected"] is True and shown[bad.url]["ejections"] == 1
    assert shown[bad.url]["state"] == "up"  # (it answers: health has nothing against it)
    assert health["ready"] is True
    page = setup.get("/").answer().body
    assert b'class="instance state-ejected"' in page

    # Back after 30 s; still failing, out again for twice as long, said once more.
    setup.proxy.advance(30)
    assert setup.scrape()[("nixlproxy_backend_ejected", labels)] == 0
    codes = [completion(setup) for _ in range(10)]
    assert codes.count(500) == 5
    assert len(ejections(logged)) == 2 and "60 s" in ejections(logged)[1]


def test_a_prefill_answering_500_is_ejected_too() -> None:
    setup = Setup(prefills=2, outlier_consecutive_failures=2)
    bad = setup.prefills[1]
    for _ in range(10):
        bad.crash_next(500, "engine error")
    codes = [completion(setup) for _ in range(8)]
    assert codes.count(502) == 2 and codes[4:] == [200] * 4
    assert len(bad.requests) == 2


def test_the_last_instance_of_a_pool_is_never_ejected() -> None:
    setup = Setup(outlier_consecutive_failures=1)
    for _ in range(3):
        setup.decode.crash_next(500, "KV load failed")
    assert [completion(setup) for _ in range(4)] == [500, 500, 500, 200]


def test_off_keeps_it_in_rotation() -> None:
    setup = Setup(decodes=2, outlier_consecutive_failures=0)
    for _ in range(10):
        setup.decodes[1].crash_next(500, "KV load failed")
    codes = [completion(setup) for _ in range(20)]
    assert codes.count(500) == 10
