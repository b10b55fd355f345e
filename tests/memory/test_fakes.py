"""The fake vLLM itself, in memory: it must catch a proxy that gets the protocol wrong."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import ensureDeferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from nixl_twisted.testing import FakeVLLM, Fault, TransferLedger
from nixl_twisted.testing.kv_publisher import KvPublisher


def post(stub: StubTreq, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` to the fake behind ``stub``; its status and JSON answer."""
    answered: list[tuple[int, Any]] = []

    async def ask() -> None:
        response = await stub.post(url, json=body)  # type: ignore[attr-defined]
        answered.append((response.code, json.loads(await response.content())))

    ensureDeferred(ask())
    stub.flush()
    (answer,) = answered
    return answer


def test_decode_refuses_rebuilt_params_as_a_kv_load_failure() -> None:
    ledger = TransferLedger()
    prefill = FakeVLLM(name="fake-prefill", ledger=ledger)
    decode = FakeVLLM(name="fake-decode", ledger=ledger)
    to_prefill, to_decode = StubTreq(prefill.resource()), StubTreq(decode.resource())

    _, answer = post(
        to_prefill,
        "http://prefill/v1/completions",
        {"prompt": "a b c", "kv_transfer_params": {"do_remote_decode": True}},
    )
    params = answer["kv_transfer_params"]
    rebuilt = {k: params[k] for k in ("remote_engine_id", "remote_request_id")}
    rebuilt["do_remote_prefill"] = True
    code, answer = post(
        to_decode,
        "http://decode/v1/completions",
        {"prompt": "a b c", "kv_transfer_params": rebuilt},
    )
    assert code == 500
    assert "KV load failed" in answer["error"]["message"]

    code, _ = post(
        to_decode, "http://decode/v1/completions", {"prompt": "a b c", "kv_transfer_params": params}
    )
    assert code == 200
    assert [r.role for r in prefill.requests] == ["prefill"]
    assert [r.role for r in decode.requests] == ["decode", "decode"]


def test_a_subclass_of_the_fake_serves_its_own_handler() -> None:
    """The routes are made once for every fake; each call still finds the fake's own method."""

    class TokenizesNothing(FakeVLLM):
        def _tokenize(self, request: Any) -> bytes:
            return b'{"count": 0, "tokens": []}'

    status, answer = post(
        StubTreq(TokenizesNothing(name="custom").resource()),
        "http://fake/tokenize",
        {"prompt": "a b c"},
    )
    assert (status, answer) == (200, {"count": 0, "tokens": []})


class Exchange:
    """One request to a fake's own site over a ``StringTransport``: what it wrote so far."""

    def __init__(self, fake: FakeVLLM, body: dict[str, Any]) -> None:
        self.channel = fake.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
        assert self.channel is not None
        self.channel.timeOut = None  # no idle timer on the global reactor
        self.transport = StringTransport()
        self.channel.makeConnection(self.transport)
        raw = json.dumps(body).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: fake\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n"
        )
        self.channel.dataReceived(head.encode() + raw)

    def events(self) -> int:
        """The SSE events written so far."""
        return self.transport.value().count(b"data: ")

    def answered(self) -> bool:
        return self.transport.value().startswith(b"HTTP/1.1 200")

    def silent(self) -> bool:
        """Nothing written yet, not even a status line."""
        return self.transport.value() == b""

    def leave(self) -> None:
        """The client goes away."""
        self.channel.connectionLost(Failure(ConnectionDone("the client left")))


def at(clock: Clock, when: float) -> None:
    """Let ``clock`` reach ``when`` half a second at a time (every time here is a multiple).

    One ``advance`` past two timers chained one after the other would fire
    the second late, at the end of the advance.
    """
    while clock.seconds() < when:
        clock.advance(0.5)


def computing_decode(clock: Clock, stalls: bool) -> FakeVLLM:
    """A decode fake: four tokens a second apart, a second per computed token."""
    return FakeVLLM(
        name="decode-0",
        clock=clock,
        tokens=4,
        token_interval=1.0,
        prefill_cost_per_token=1.0,
        computing_stalls_streams=stalls,
    )


@pytest.mark.parametrize("stalls", [False, True])
def test_a_compute_holds_back_the_next_token_of_every_stream_on_its_instance(
    stalls: bool,
) -> None:
    clock = Clock()
    fake = computing_decode(clock, stalls)
    # "abcd": one token, computed in 1 s; then an event a second (4 words, [DONE]).
    stream = Exchange(fake, {"prompt": "abcd", "stream": True})
    at(clock, 2)
    assert stream.events() == 2
    # Ten tokens not cached: a 10 s compute, from 2 s to 12 s.
    computed = Exchange(fake, {"prompt": "x" * 40})

    at(clock, 3)
    assert stream.events() == (2 if stalls else 3)
    at(clock, 11.5)
    assert stream.events() == (2 if stalls else 5)
    assert not computed.answered()
    at(clock, 12)
    assert computed.answered()
    # The stalled event comes as the compute ends, then the interval resumes.
    assert stream.events() == (3 if stalls else 5)
    at(clock, 13)
    assert stream.events() == (4 if stalls else 5)


def test_a_stalled_stream_waits_for_a_compute_that_starts_while_it_waits() -> None:
    clock = Clock()
    fake = computing_decode(clock, stalls=True)
    stream = Exchange(fake, {"prompt": "abcd", "stream": True})
    at(clock, 2)
    Exchange(fake, {"prompt": "x" * 16})  # 2 s to 6 s
    at(clock, 4)
    Exchange(fake, {"prompt": "y" * 32})  # 4 s to 12 s: the stream's wait grows
    at(clock, 6)
    assert stream.events() == 2
    at(clock, 12)
    assert stream.events() == 3


def test_a_decode_leg_pulls_its_kv_before_its_first_token_and_only_a_decode_leg() -> None:
    clock = Clock()
    ledger = TransferLedger()
    prefill = FakeVLLM(name="prefill-0", ledger=ledger)
    decode = FakeVLLM(
        name="decode-0",
        ledger=ledger,
        clock=clock,
        kv_load_latency=2.0,
        kv_load_cost_per_token=0.5,
    )
    prompt = "x" * 40  # ten tokens: 2 s + 10 x 0.5 s
    _, answer = post(
        StubTreq(prefill.resource()),
        "http://prefill/v1/completions",
        {"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}},
    )
    leg = Exchange(decode, {"prompt": prompt, "kv_transfer_params": answer["kv_transfer_params"]})
    plain = Exchange(decode, {"prompt": prompt})
    assert plain.answered()
    at(clock, 6.5)
    assert not leg.answered()
    at(clock, 7)
    assert leg.answered()
    assert [r.role for r in decode.requests] == ["decode", "plain"]


def test_a_request_says_whether_it_carried_kv_transfer_params() -> None:
    ledger = TransferLedger()
    prefill, decode = FakeVLLM(name="p", ledger=ledger), FakeVLLM(name="d", ledger=ledger)
    to_prefill, to_decode = StubTreq(prefill.resource()), StubTreq(decode.resource())
    _, answer = post(
        to_prefill,
        "http://prefill/v1/completions",
        {"prompt": "a b c", "kv_transfer_params": {"do_remote_decode": True}},
    )
    post(
        to_decode,
        "http://decode/v1/completions",
        {"prompt": "a b c", "kv_transfer_params": answer["kv_transfer_params"]},
    )
    post(to_decode, "http://decode/v1/completions", {"prompt": "a b c"})
    post(to_decode, "http://decode/v1/completions", {"prompt": "a", "kv_transfer_params": None})

    assert [r.carried_kv_transfer_params for r in prefill.requests] == [True]
    assert [(r.role, r.carried_kv_transfer_params) for r in decode.requests] == [
        ("decode", True),
        ("plain", False),
        ("plain", True),  # null is still the key: a decode-only leg must not send it
    ]


# -- capacity: max_num_seqs and max_num_queued_reqs --------------------------------


def gauges(fake: FakeVLLM) -> tuple[float, float]:
    """``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, read from ``/metrics``."""
    read: list[bytes] = []

    async def ask() -> None:
        response = await StubTreq(fake.resource()).get("http://fake/metrics")  # type: ignore[attr-defined]
        read.append(await response.content())

    ensureDeferred(ask())
    (text,) = read
    found = {}
    for line in text.decode().splitlines():
        found[line.partition("{")[0]] = float(line.rsplit(" ", 1)[1])
    return found["vllm:num_requests_running"], found["vllm:num_requests_waiting"]


def streams(fake: FakeVLLM, count: int) -> list[Exchange]:
    """``count`` streaming completions sent to ``fake`` one after the other."""
    return [Exchange(fake, {"prompt": "abcd", "stream": True}) for _ in range(count)]


def capped(clock: Clock, max_num_seqs: int, **options: Any) -> FakeVLLM:
    """A fake whose streams take 2 s: two tokens a second apart, then ``[DONE]``."""
    return FakeVLLM(
        name="decode-0",
        clock=clock,
        tokens=2,
        token_interval=1.0,
        max_num_seqs=max_num_seqs,
        **options,
    )


def test_at_most_max_num_seqs_run_and_the_rest_wait_first_come_first_served() -> None:
    clock = Clock()
    fake = capped(clock, max_num_seqs=2)
    a, b, c, d, e = streams(fake, 5)
    assert [s.events() for s in (a, b)] == [1, 1]
    assert all(s.silent() for s in (c, d, e))  # not even a status line
    assert gauges(fake) == (2, 3)
    at(clock, 2)  # a and b end; c and d, the first to wait, start
    assert [s.events() for s in (a, b, c, d)] == [3, 3, 1, 1]
    assert e.silent()
    assert gauges(fake) == (2, 1)
    at(clock, 4)
    assert [s.events() for s in (c, d, e)] == [3, 3, 1]
    assert gauges(fake) == (1, 0)
    at(clock, 6)
    assert e.events() == 3 and gauges(fake) == (0, 0)


def test_without_max_num_seqs_every_request_runs_at_once() -> None:
    clock = Clock()
    fake = capped(clock, max_num_seqs=0)
    started = streams(fake, 5)
    assert [s.events() for s in started] == [1] * 5
    assert gauges(fake) == (5, 0)
    at(clock, 2)
    assert [s.events() for s in started] == [3] * 5
    assert gauges(fake) == (0, 0)


def test_a_waiting_request_computes_its_prompt_only_once_it_runs() -> None:
    clock = Clock()
    fake = FakeVLLM(name="plain-0", clock=clock, max_num_seqs=1, prefill_cost_per_token=1.0)
    first = Exchange(fake, {"prompt": "x" * 16})  # four tokens: 4 s
    second = Exchange(fake, {"prompt": "abcd"})  # one token: 1 s, once it runs
    assert fake.cache.queries == 4  # the second's prompt not even looked up yet
    at(clock, 4)
    assert first.answered() and second.silent()
    assert fake.cache.queries == 5
    at(clock, 5)
    assert second.answered()


def test_a_prefill_leg_holds_a_slot_while_it_computes() -> None:
    clock = Clock()
    fake = FakeVLLM(name="prefill-0", clock=clock, max_num_seqs=1, prefill_cost_per_token=1.0)
    leg = Exchange(fake, {"prompt": "x" * 16, "kv_transfer_params": {"do_remote_decode": True}})
    (stream,) = streams(fake, 1)
    at(clock, 3.5)
    assert leg.silent() and stream.silent()
    assert gauges(fake) == (1, 1)
    at(clock, 4)
    assert leg.answered() and b"do_remote_prefill" in leg.transport.value()
    assert gauges(fake) == (1, 0)  # the stream runs: its own prompt's second of compute
    assert stream.silent()
    at(clock, 5)
    assert stream.answered()


def test_a_request_whose_client_leaves_while_waiting_leaves_the_queue() -> None:
    clock = Clock()
    fake = capped(clock, max_num_seqs=1)
    running, gone, next_one = streams(fake, 3)
    gone.leave()
    assert fake.disconnects == 1
    assert gauges(fake) == (1, 1)
    at(clock, 2)  # the running one ends: the next in line runs, not the one that left
    assert running.events() == 3 and next_one.events() == 1
    assert gone.silent()
    assert gauges(fake) == (1, 0)
    at(clock, 4)
    assert gauges(fake) == (0, 0)


def test_a_running_request_whose_client_leaves_gives_its_slot_to_the_next() -> None:
    clock = Clock()
    fake = capped(clock, max_num_seqs=1)
    running, waiting = streams(fake, 2)
    running.leave()
    assert waiting.events() == 1
    assert gauges(fake) == (1, 0)
    at(clock, 2)
    assert waiting.events() == 3 and gauges(fake) == (0, 0)


def test_past_max_num_queued_reqs_a_request_is_refused_with_vllms_503() -> None:
    """vLLM counts requests waiting or running against --max-num-queued-reqs."""
    clock = Clock()
    fake = capped(clock, max_num_seqs=1, max_num_queued_reqs=2)
    streams(fake, 2)  # one running, one waiting: full
    code, answer = post(StubTreq(fake.resource()), "http://fake/v1/completions", {"prompt": "a"})
    assert (code, answer) == (
        503,
        {
            "error": {
                "message": "The engine is currently busy and cannot accept new requests. "
                "Please try again later or on a different instance.",
                "type": "Service Unavailable",
                "param": None,
                "code": 503,
            }
        },
    )
    assert gauges(fake) == (1, 1)
    at(clock, 2)  # the first ends: room for one more to wait
    (admitted,) = streams(fake, 1)
    assert admitted.silent() and gauges(fake) == (1, 1)
    code, _ = post(StubTreq(fake.resource()), "http://fake/v1/completions", {"prompt": "a"})
    assert code == 503
    at(clock, 6)
    assert admitted.events() == 3 and gauges(fake) == (0, 0)


def test_a_prompts_kv_events_go_out_once_its_compute_has_run_in_the_order_of_the_cache() -> None:
    """As vLLM publishes an engine step's events after the step: a router that routes
    meanwhile sees nothing yet, and what the cache did is never reordered."""
    clock = Clock()
    fake = FakeVLLM(clock=clock, block_tokens=4, prefill_cost_per_token=1.0)
    publisher = KvPublisher(reactor)  # never bound: it keeps what it would send
    fake.kv_publisher = publisher
    try:
        first = Exchange(fake, {"prompt": "a" * 32})  # 8 tokens, two blocks: 8 s
        second = Exchange(fake, {"prompt": "b" * 16})  # 4 tokens, one block: 4 s
        at(clock, 4)
        assert second.answered() and not first.answered()
        assert publisher.seq == 0  # its step ran, but the cache changed for the first before
        at(clock, 8)
        assert first.answered()
        stored = [msgpack.unpackb(payload)[1][0]["block_hashes"] for _, payload in publisher.buffer]
        assert [len(hashes) for hashes in stored] == [2, 1]
    finally:
        publisher.close()


def test_one_instance_fails_every_request_as_its_fault_says_until_healed() -> None:
    """One decode of two whose KV loads all fail, then whose engine errs: the other serves."""
    ledger = TransferLedger()
    prefill = StubTreq(FakeVLLM(name="prefill-0", ledger=ledger).resource())
    healthy, faulty = (FakeVLLM(name=f"decode-{i}", ledger=ledger) for i in range(2))
    faulty.fault = Fault.FAIL_KV
    to_healthy, to_faulty = StubTreq(healthy.resource()), StubTreq(faulty.resource())
    leg = {"prompt": "a b c", "kv_transfer_params": {"do_remote_decode": True}}

    for _ in range(3):  # every one of its legs, not the next alone
        _, answer = post(prefill, "http://p/v1/completions", leg)
        decode_leg = {"prompt": "a b c", "kv_transfer_params": answer["kv_transfer_params"]}
        code, failed = post(to_faulty, "http://d/v1/completions", decode_leg)
        assert (code, failed["error"]["message"]) == (
            500,
            "KV load failed: the fake's fault: fail-kv",
        )
        code, _ = post(to_healthy, "http://d/v1/completions", decode_leg)
        assert code == 200  # its prefill's KV is still there for another decode
    assert (faulty.sources.failed_transfers, healthy.sources.failed_transfers) == (3, 0)
    plain = {"prompt": "a b c"}
    assert post(to_faulty, "http://d/v1/completions", plain)[0] == 200  # no KV to load

    faulty.fault = Fault.ERROR_500
    code, answer = post(to_faulty, "http://d/v1/completions", plain)
    assert (code, answer["error"]["code"]) == (500, 500)
    faulty.fault = None  # healed
    assert post(to_faulty, "http://d/v1/completions", plain)[0] == 200


def test_a_hung_instance_takes_every_request_and_answers_none_but_its_health() -> None:
    fake = FakeVLLM(fault=Fault.HANG)
    stub = StubTreq(fake.resource())
    answered: list[object] = []
    stub.post("http://d/v1/completions", json={"prompt": "a"}).addBoth(answered.append)  # type: ignore[attr-defined]
    stub.flush()
    assert answered == [] and len(fake.requests) == 1
    health = stub.get("http://d/health")  # type: ignore[attr-defined]
    stub.flush()
    assert health.result.code == 200
