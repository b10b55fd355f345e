"""vLLM's ``GET /kv_event_sources`` read: each rank's endpoints, or why none, within bounds."""

from __future__ import annotations

import json

import pytest

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.config.values import MAX_RANKS
from nixl_twisted.kv.sources import (
    MAX_ANSWER,
    SourcesError,
    for_rank,
    read_sources,
    refusal,
)
from nixl_twisted.kv.stream import Endpoints

#: What the real p1 (vLLM 0.32, one rank) answered.
REAL = (
    b'{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5701",'
    b'"replay_endpoint":"tcp://*:5702","buffer_steps":10000,"hwm":100000,'
    b'"max_queue_size":100000,"topic":"kv"}}'
)


def publisher(endpoint: object, replay: str | None = None, **more: object) -> dict[str, object]:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
        **more,
    }


def answer(**ranks: object) -> bytes:
    return json.dumps({key.removeprefix("r"): value for key, value in ranks.items()}).encode()


def test_vllms_answer_gives_the_instances_own_host_for_the_wildcard() -> None:
    assert read_sources(REAL, "10.0.0.5") == {
        0: Endpoints("tcp://10.0.0.5:5701", "tcp://10.0.0.5:5702")
    }


@pytest.mark.parametrize("wildcard", ["*", "0.0.0.0", "::", "[::]"])
def test_every_any_address_is_the_instances_host(wildcard: str) -> None:
    ranks = read_sources(answer(r0=publisher(f"tcp://{wildcard}:5557")), "[fd00::5]")
    assert ranks == {0: Endpoints("tcp://[fd00::5]:5557")}


def test_each_data_parallel_rank_has_its_own_ports_as_vllm_offsets_them() -> None:
    body = answer(
        **{f"r{i}": publisher(f"tcp://*:{5557 + i}", f"tcp://*:{5657 + i}") for i in range(3)}
    )
    ranks = read_sources(body, "h")
    assert for_rank(ranks, 2) == Endpoints("tcp://h:5559", "tcp://h:5659")
    assert for_rank(ranks, 3) == "rank 3 is not among the ranks it lists (0, 1, 2)"
    # A URL without #dp= in front of several ranks: which one serves a leg is vLLM's choice.
    assert for_rank(ranks, None) == "it has 3 data-parallel ranks: give its URL #dp=3"


def test_a_concrete_host_is_kept() -> None:
    ranks = read_sources(answer(r0=publisher("tcp://10.1.2.3:5557")), "vllm-0")
    assert for_rank(ranks, None) == Endpoints("tcp://10.1.2.3:5557")


def test_events_off_say_so() -> None:
    assert for_rank(read_sources(b"{}", "h"), None) == (
        "its KV events are off (it lists no publisher)"
    )
    off = answer(r0={"enable_kv_cache_events": False, "publisher": "null"})
    assert for_rank(read_sources(off, "h"), 0) == (
        "its KV events are off (enable_kv_cache_events, publisher zmq)"
    )


def test_an_ipc_publisher_cannot_be_reached_and_an_ipc_replay_is_left_out() -> None:
    ranks = read_sources(answer(r0=publisher("ipc:///tmp/kv")), "h")
    assert ranks[0] == "it publishes on ipc:///tmp/kv, which only its own machine reaches"
    ranks = read_sources(answer(r0=publisher("tcp://*:5557", "inproc://replay")), "h")
    assert ranks[0] == Endpoints("tcp://h:5557")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "the answer is not JSON"),
        (b"[]", "the answer is an object of ranks, not list"),
        (answer(rx=publisher("tcp://*:1")), "rank 'x' is not a number"),
        (answer(r0="zmq"), "a rank's publisher is an object, not str"),
        (answer(r0=publisher("tcp://*:0")), "endpoint 'tcp://*:0' has no port"),
        (answer(r0=publisher("udp://*:5557")), "endpoint 'udp://*:5557' is not tcp://HOST:PORT"),
        (answer(r0=publisher(7)), "an endpoint is a string of at most 300 characters"),
        (
            answer(r0=publisher("tcp://" + "h" * 300 + ":1")),
            "an endpoint is a string of at most 300 characters",
        ),
    ],
)
def test_what_is_not_an_answer_is_refused_with_its_reason(body: bytes, why: str) -> None:
    with pytest.raises(SourcesError) as raised:
        read_sources(body, "h")
    assert str(raised.value) == why


def test_an_answer_is_bounded_in_bytes_and_ranks() -> None:
    with pytest.raises(SourcesError, match="more than"):
        read_sources(b" " * (MAX_ANSWER + 1), "h")
    many = json.dumps({str(i): {} for i in range(MAX_RANKS + 1)}).encode()
    assert len(many) < MAX_ANSWER
    with pytest.raises(SourcesError, match=f"{MAX_RANKS + 1} ranks"):
        read_sources(many, "h")


def test_a_host_the_answer_names_is_held_to_the_allowed_backends() -> None:
    allowed = AllowedBackends(["10.0.0.0/8"])
    assert refusal(Endpoints("tcp://vllm-0:5557"), "vllm-0", allowed) is None  # its own
    assert refusal(Endpoints("tcp://10.1.2.3:5557"), "vllm-0", allowed) is None
    assert refusal(Endpoints("tcp://10.1.2.3:5557", "tcp://192.168.0.9:5558"), "x", allowed) == (
        "tcp://192.168.0.9:5558: 192.168.0.9 is in no network of --allowed-backends"
    )
    assert refusal(Endpoints("tcp://169.254.169.254:80"), "x", AllowedBackends()) is not None
