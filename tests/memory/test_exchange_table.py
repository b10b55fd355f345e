"""Each row of the exchange's table (``phases.RULES``, ``docs/failures.md``), in memory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from zope.interface import provider

from nixl_twisted.protocol.phases import RULES, OnClientLeft, Phase
from nixl_twisted.testing import FakeVLLM, InMemoryProxy, TransferLedger
from tests.memory.support import CHAT, STREAM, TIMEOUTS, Setup, error_code, sse_events, status

FAILURES = Path(__file__).resolve().parents[2] / "docs" / "failures.md"


def test_the_table_in_the_docs_is_the_table_in_the_code() -> None:
    rows = re.findall(
        r"^\| `(\w+)` \|[^|]*\|[^|]*\| `(\w+)`[^|]*\|([^|]*)\|$",
        FAILURES.read_text(encoding="utf-8"),
        re.M,
    )
    documented = {
        Phase(phase): (OnClientLeft(reaction), tuple(re.findall(r"`--([a-z-]+)`", timers)))
        for phase, reaction, timers in rows
    }
    assert documented == {phase: (r.on_client_left, r.timers) for phase, r in RULES.items()}


# -- the client leaves ---------------------------------------------------------


def test_client_leaves_while_queued_and_nothing_is_sent() -> None:
    setup = Setup(decode_max_in_flight=1)
    setup.decode.hold_answers()
    first = setup.post("/v1/chat/completions", CHAT)  # holds the one decode slot
    ahead = setup.post("/v1/chat/completions", CHAT)  # prefilled, ready for decode
    client = setup.post("/v1/chat/completions", CHAT)  # waits for its prefill
    queued = [e for e in setup.proxy.app.serving.exchanges if e.phase.value == "queued"]
    assert len(queued) == 2
    client.disconnect()
    assert len(setup.prefill.requests) == 2  # the first's and the one ahead's alone
    setup.decode.release()
    setup.proxy.flush()
    assert status(first) == status(ahead) == 200 and len(setup.decode.requests) == 2
    assert setup.proxy.app.in_flight == 0


def test_client_leaves_during_prefill_cancels_prefill_and_sends_no_decode() -> None:
    setup = Setup()
    setup.prefill.hold_answers()
    client = setup.post("/v1/chat/completions", CHAT)
    assert setup.phase() == "prefill"
    client.disconnect()
    assert setup.prefill.disconnects == 1  # its connection closed: vLLM frees what it computed
    assert setup.decode.requests == []
    assert setup.proxy.app.in_flight == 0


def test_client_leaves_during_handoff_still_sends_decode_then_abandons_it() -> None:
    setup = Setup()
    setup.prefill.hold_answers_midway()  # prefill's headers are in: it holds KV blocks
    client = setup.post("/v1/chat/completions", CHAT)
    assert setup.phase() == "handoff"
    client.disconnect()
    setup.prefill.release()
    setup.proxy.flush()
    (decode,) = setup.decode.requests
    assert decode.role == "decode"  # decode loaded the blocks, so prefill frees them
    assert setup.ledger.redeemed == [decode.connector_params]
    assert setup.ledger.issued == {}
    assert setup.proxy.app.in_flight == 0
    assert setup.proxy.app.serving.exchanges == set()


def test_client_leaves_a_decode_only_request_and_its_decode_request_is_cancelled() -> None:
    setup = Setup(decode_only_below=64)
    setup.decode.hold_answers()
    client = setup.post("/v1/chat/completions", CHAT)
    assert setup.phase() == "decode"
    client.disconnect()
    assert setup.decode.disconnects == 1  # no prefill holds blocks for it: vLLM aborts it
    assert setup.prefill.requests == []
    assert setup.proxy.app.in_flight == 0
    assert [i.in_flight for i in setup.proxy.service.backends.decode.instances] == [0]


def test_a_batch_cancelling_a_part_in_handoff_follows_the_table_and_blames_no_client() -> None:
    ledger = TransferLedger()
    held, failing = (FakeVLLM(name=f"prefill-{i}", ledger=ledger) for i in range(2))
    decode = FakeVLLM(name="decode-0", ledger=ledger)
    proxy = InMemoryProxy([held, failing], [decode])
    held.hold_answers_midway()  # part 0's prefill headers are in: it holds KV blocks
    failing.crash_next(500)  # part 1 fails: the batch cancels part 0, in handoff
    events: list[dict[str, Any]] = []

    @provider(ILogObserver)
    def observer(event: dict[str, Any]) -> None:
        events.append(event)

    globalLogPublisher.addObserver(observer)
    try:
        body = json.dumps({"model": "m", "prompt": ["a", "b"]}).encode()
        client = proxy.request("POST", "/v1/completions", body)
        assert (status(client), error_code(client)) == (502, "prefill_failed")
        assert held.disconnects == 0 and decode.requests == []  # part 0: still in handoff
        held.release()
        proxy.flush()
    finally:
        globalLogPublisher.removeObserver(observer)
    assert held.disconnects == 0  # the handoff was let finish, as the table says
    (sent,) = decode.requests  # decode loaded the blocks, so prefill frees them
    assert ledger.redeemed == [sent.body["kv_transfer_params"]]  # type: ignore[index]
    assert proxy.app.serving.exchanges == set()
    assert not [e for e in events if "client left" in formatEvent(e)]
    assert b"nixlproxy_client_disconnects_total{" not in proxy.app.metrics.exposition()


def test_client_leaves_during_relay_closes_the_decode_connection() -> None:
    setup = Setup()
    setup.decode.hold_streams_after(2)
    client = setup.post("/v1/chat/completions", STREAM)
    assert setup.phase() == "relay"
    client.disconnect()
    assert setup.decode.disconnects == 1
    assert setup.proxy.app.in_flight == 0


# -- a timer runs out ----------------------------------------------------------


def test_prefill_timeout_is_a_504_and_no_decode() -> None:
    setup = Setup()
    setup.prefill.hold_answers()
    client = setup.post("/v1/chat/completions", CHAT)
    setup.proxy.advance(TIMEOUTS.prefill - 0.001)
    assert client.received() == b""  # not yet
    setup.proxy.advance(0.001)
    assert (status(client), error_code(client)) == (504, "prefill_timeout")
    assert setup.prefill.disconnects == 1
    assert setup.decode.requests == []


def test_decode_timeout_in_handoff_is_a_504() -> None:
    setup = Setup()
    setup.decode.hold_answers()
    client = setup.post("/v1/chat/completions", CHAT)
    assert setup.phase() == "handoff"
    setup.proxy.advance(TIMEOUTS.decode)
    assert (status(client), error_code(client)) == (504, "decode_timeout")
    assert setup.decode.disconnects == 1  # vLLM aborts the request and frees its blocks
    (decode,) = setup.proxy.service.backends.decode.instances
    # A slow answer, not a dead instance: one failure of the three that mark it down.
    assert (decode.healthy, decode.failures) == (True, 1)


def test_decode_timeout_of_a_decode_only_request_is_a_504() -> None:
    setup = Setup(decode_only_below=64)
    setup.decode.hold_answers()
    client = setup.post("/v1/chat/completions", CHAT)
    assert setup.phase() == "decode"
    setup.proxy.advance(TIMEOUTS.decode)
    assert (status(client), error_code(client)) == (504, "decode_timeout")
    assert setup.decode.disconnects == 1
    assert setup.prefill.requests == []


def test_stream_idle_timeout_in_relay_ends_with_an_error_event_and_a_short_close() -> None:
    setup = Setup(decode_migrations=0)
    setup.decode.hold_streams_after(2)
    client = setup.post("/v1/chat/completions", STREAM)
    setup.proxy.advance(TIMEOUTS.stream_idle - 0.001)
    assert setup.phase() == "relay"  # a slow stream is not yet a silent one
    setup.proxy.advance(0.001)
    events = sse_events(client)
    assert events[-1]["error"]["code"] == "decode_timeout"
    assert "[DONE]" not in events
    assert not client.answer().complete  # no final chunk: never complete-looking
    assert client.lost
    assert setup.decode.disconnects == 1
