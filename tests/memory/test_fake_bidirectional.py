"""The fakes' bidirectional transfer, as vLLM 0.32-0.34's: decode's handle, read back by prefill.

A proxy test can only show reuse working, or misused, if the fakes answer
a handle where vLLM does, render a conversation's next turn to ids that
extend what decode held, and give a wrong answer where vLLM would.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from treq.testing import StubTreq
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock

from nixl_twisted.testing import FakeVLLM, SharedLedger, TransferLedger
from nixl_twisted.testing import __main__ as fakes_command
from tests.memory.test_fakes import post

QUESTION = [{"role": "user", "content": "What moves the KV cache between instances, and how?"}]
LOWERED = {"max_tokens": 1, "stream": False}
ASK_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_request_id": None,
    "remote_host": None,
    "remote_port": None,
}
HANDLE_KEYS = [
    "do_remote_decode",
    "do_remote_prefill",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_registration_generation",
]


class Fleet:
    """A prefill and a decode fake sharing a ledger and a clock, as a test of a proxy has."""

    def __init__(self, bidirectional: bool = True, **options: Any) -> None:
        self.clock = Clock()
        self.ledger = TransferLedger()
        self.prefill, self.decode = (
            FakeVLLM(
                name=name,
                ledger=self.ledger,
                clock=self.clock,
                bidirectional=bidirectional,
                **options,
            )
            for name in ("prefill-0", "decode-0")
        )
        self.to_prefill = StubTreq(self.prefill.resource())
        self.to_decode = StubTreq(self.decode.resource())

    def two_legs(
        self, path: str, body: dict[str, Any], params: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        """A prefill leg (``params``: what it is handed, else an ordinary lowering), then
        the decode leg with what the prefill answered: the decode leg's status and answer."""
        lowered = dict(body, **LOWERED, kv_transfer_params=params or ASK_PREFILL)
        status, answer = post(self.to_prefill, f"http://p{path}", lowered)
        if status != 200:
            return status, answer
        leg = dict(body, kv_transfer_params=answer["kv_transfer_params"])
        return post(self.to_decode, f"http://d{path}", leg)

    def rendered(self, messages: list[dict[str, Any]]) -> list[int]:
        _, answer = post(
            self.to_prefill,
            "http://p/v1/chat/completions/render",
            {"model": "m", "messages": messages},
        )
        ids: list[int] = answer["token_ids"]
        return ids


def raw(stub: StubTreq, url: str, body: dict[str, Any]) -> bytes:
    """The bytes of the fake's answer (a stream's whole body)."""
    answered: list[bytes] = []

    async def ask() -> None:
        response = await stub.post(url, json=body)  # type: ignore[attr-defined]
        answered.append(await response.content())

    ensureDeferred(ask())
    stub.flush()
    (answer,) = answered
    return answer


def chat(messages: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "return_token_ids": True, **more}


def first_turn(fleet: Fleet) -> tuple[Any, list[dict[str, Any]]]:
    """The first turn's answer, and the next turn's messages (its answer, a new question)."""
    status, answer = fleet.two_legs("/v1/chat/completions", chat(QUESTION))
    assert status == 200
    said = answer["choices"][0]["message"]["content"]
    follow = [{"role": "assistant", "content": said}, {"role": "user", "content": "And back?"}]
    return answer, QUESTION + follow


def test_decode_answers_a_handle_last_in_a_whole_chat_pinned_for_its_ttl() -> None:
    fleet = Fleet(decoder_blocks_ttl=30.0)
    fleet.clock.advance(7)
    status, answer = fleet.two_legs("/v1/chat/completions", chat(QUESTION))

    assert status == 200
    assert list(answer)[-1] == "kv_transfer_params"  # (pydantic's order: the last field)
    handle = answer["kv_transfer_params"]
    assert list(handle) == HANDLE_KEYS
    assert handle["do_remote_decode"] is True and handle["do_remote_prefill"] is False
    assert handle["remote_engine_id"] == "decode-0"
    assert handle["remote_blocks_expiry_time"] == 37.0  # decode's clock, its TTL on
    prompt, output = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
    assert handle["remote_num_tokens"] == prompt + output - 1
    assert fleet.decode.handles_issued == [handle]


def test_decode_answers_a_handle_in_a_whole_text_completion() -> None:
    fleet = Fleet()
    status, answer = fleet.two_legs("/v1/completions", {"model": "m", "prompt": [5, 6, 7]})

    assert status == 200
    assert answer["kv_transfer_params"]["remote_num_tokens"] == 3 + 8 - 1


def test_no_handle_unless_a_two_leg_request_on_a_bidirectional_decode() -> None:
    plain_fleet = Fleet()
    _, plain = post(plain_fleet.to_decode, "http://d/v1/chat/completions", chat(QUESTION))
    _, one_way = Fleet(bidirectional=False).two_legs("/v1/chat/completions", chat(QUESTION))

    assert "kv_transfer_params" not in plain and "kv_transfer_params" not in one_way
    assert plain_fleet.decode.handles_issued == []


def test_responses_answer_the_handle_whole_and_in_response_completed() -> None:
    fleet = Fleet()
    body = {"model": "m", "input": "Why?"}
    _, whole = fleet.two_legs("/v1/responses", body)
    assert whole["kv_transfer_params"]["remote_engine_id"] == "decode-0"

    _, prefilled = post(
        fleet.to_prefill,
        "http://p/v1/responses",
        dict(body, **LOWERED, kv_transfer_params=ASK_PREFILL),
    )
    stream = raw(
        fleet.to_decode,
        "http://d/v1/responses",
        dict(body, stream=True, kv_transfer_params=prefilled["kv_transfer_params"]),
    )
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith(b"data: ")]
    (completed,) = [e for e in events if e["type"] == "response.completed"]
    assert completed["response"]["kv_transfer_params"] == fleet.decode.handles_issued[-1]
    assert all("kv_transfer_params" not in e.get("response", {}) for e in events[:-1])


def streamed(fleet: Fleet) -> list[dict[str, Any]]:
    """A streamed two-leg chat's chunks, as the decode wrote them."""
    _, prefilled = post(
        fleet.to_prefill,
        "http://p/v1/chat/completions",
        chat(QUESTION, **LOWERED, kv_transfer_params=ASK_PREFILL),
    )
    leg = chat(QUESTION, stream=True, kv_transfer_params=prefilled["kv_transfer_params"])
    stream = raw(fleet.to_decode, "http://d/v1/chat/completions", leg)
    lines = [line[6:] for line in stream.splitlines() if line.startswith(b"data: ")]
    return [json.loads(line) for line in lines if line != b"[DONE]"]


def test_a_stream_carries_no_handle_as_vllm_032() -> None:
    fleet = Fleet()
    chunks = streamed(fleet)

    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("kv_transfer_params" not in chunk for chunk in chunks)
    assert fleet.decode.handles_issued == []


def test_with_streams_handle_the_finishing_chunk_carries_it_as_vllm_033() -> None:
    fleet = Fleet(streams_handle=True)
    chunks = streamed(fleet)

    carrying = [chunk for chunk in chunks if "kv_transfer_params" in chunk]
    assert carrying == [chunks[-1]] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["kv_transfer_params"] == fleet.decode.handles_issued[0]


def test_the_next_turn_renders_to_the_ids_decode_held_and_a_changed_one_does_not() -> None:
    fleet = Fleet()
    answer, follow = first_turn(fleet)
    held = answer["prompt_token_ids"] + answer["choices"][0]["token_ids"]

    assert fleet.rendered(follow)[: len(held)] == held
    assert len(fleet.rendered(follow)) > len(held)
    changed = [{"role": "user", "content": "What moves the KV cache between instances, then?"}]
    assert fleet.rendered(changed + follow[1:])[: len(held)] != held
    edited = [dict(follow[1], content="Something else. "), follow[2]]
    assert fleet.rendered(QUESTION + edited)[: len(held)] != held


def right_answer(messages: list[dict[str, Any]]) -> Any:
    """What decode alone gives for ``messages``: two legs on fresh fakes, no handle."""
    _, answer = Fleet().two_legs("/v1/chat/completions", chat(messages))
    return answer["choices"][0]


def test_prefill_pulls_a_matching_handles_tokens_and_the_answer_is_decodes() -> None:
    fleet = Fleet(block_tokens=4)  # (blocks small enough for the first turn's to be cached)
    _, follow = first_turn(fleet)
    handle = fleet.decode.handles_issued[0]
    before = fleet.prefill.sources.external_kv_transfer
    prompt = fleet.rendered(follow)
    cached = fleet.prefill.cache.hits

    status, answer = fleet.two_legs("/v1/chat/completions", chat(follow), params=handle)

    assert status == 200
    (read,) = fleet.prefill.handles_read
    hits = fleet.prefill.cache.hits - cached  # (the first turn's prompt, held by prefill)
    assert hits > 0
    assert read["pulled"] == handle["remote_num_tokens"] - hits > 0
    assert read["extends"] and not read["again"]
    assert fleet.prefill.sources.external_kv_transfer - before == read["pulled"]
    assert answer["choices"][0]["message"] == right_answer(follow)["message"]
    assert answer["choices"][0]["token_ids"] == right_answer(follow)["token_ids"]
    assert answer["prompt_token_ids"] == prompt


def test_a_handle_for_another_sequence_or_read_twice_gives_a_wrong_answer() -> None:
    fleet = Fleet()
    _, follow = first_turn(fleet)
    handle = fleet.decode.handles_issued[0]
    other = [{"role": "user", "content": "Something else entirely, with its own words."}]
    right = right_answer(other + follow[1:])

    status, foreign = fleet.two_legs("/v1/chat/completions", chat(other + follow[1:]), handle)
    assert status == 200  # (vLLM does not check: its KV is wrong, its answer too)
    assert foreign["choices"][0]["message"] != right["message"]
    assert foreign["choices"][0]["token_ids"] != right["token_ids"]

    right = right_answer(follow)
    status, again = fleet.two_legs("/v1/chat/completions", chat(follow), handle)
    assert status == 200
    assert again["choices"][0]["message"] != right["message"]
    assert again["choices"][0]["token_ids"] != right["token_ids"]
    assert [(r["extends"], r["again"]) for r in fleet.prefill.handles_read] == [
        (False, False),
        (True, True),
    ]


def test_below_the_recompute_threshold_nothing_is_pulled_and_nothing_is_wrong() -> None:
    fleet = Fleet(kv_recompute_threshold=64)  # (vLLM's default: the first turn holds fewer)
    _, follow = first_turn(fleet)
    handle = fleet.decode.handles_issued[0]
    other = [{"role": "user", "content": "Something else entirely, with its own words."}]

    status, answer = fleet.two_legs("/v1/chat/completions", chat(other + follow[1:]), handle)

    assert status == 200
    assert answer["choices"][0]["token_ids"] == right_answer(other + follow[1:])["token_ids"]
    assert [r["pulled"] for r in fleet.prefill.handles_read] == [0]
    assert fleet.prefill.sources.external_kv_transfer == 0


@pytest.mark.parametrize("unknown", [False, True])
def test_an_expired_or_unknown_handle_fails_the_prefill_leg_as_vllms_default(
    unknown: bool,
) -> None:
    fleet = Fleet(decoder_blocks_ttl=60.0)
    _, follow = first_turn(fleet)
    handle = dict(fleet.decode.handles_issued[0])
    if unknown:
        handle["remote_request_id"] = "never-issued"
    else:
        fleet.clock.advance(61)

    status, answer = fleet.two_legs("/v1/chat/completions", chat(follow), handle)

    assert status == 500
    assert answer["error"]["message"].startswith("KV load failed: ")
    assert answer["error"]["code"] == 500
    assert fleet.prefill.sources.failed_transfers == 1
    assert fleet.prefill.handles_read == []


def test_with_the_recompute_policy_an_expired_handle_is_computed_and_answered_right() -> None:
    fleet = Fleet(decoder_blocks_ttl=60.0, kv_load_failure_policy="recompute")
    _, follow = first_turn(fleet)
    fleet.clock.advance(61)
    before = fleet.prefill.sources.external_kv_transfer

    handle = fleet.decode.handles_issued[0]
    status, answer = fleet.two_legs("/v1/chat/completions", chat(follow), handle)

    assert status == 200
    assert answer["choices"][0]["token_ids"] == right_answer(follow)["token_ids"]
    assert fleet.prefill.sources.external_kv_transfer == before


def test_a_prefill_not_bidirectional_ignores_a_handle() -> None:
    fleet = Fleet()
    _, follow = first_turn(fleet)
    fleet.prefill.bidirectional = False
    fleet.clock.advance(1000)  # (expired: only a reader would notice)

    status, _ = fleet.two_legs("/v1/chat/completions", chat(follow), fleet.decode.handles_issued[0])

    assert status == 200 and fleet.prefill.handles_read == []


def test_a_shared_ledger_reads_a_handle_issued_in_another_process_once(tmp_path: Any) -> None:
    issuing, reading = SharedLedger(str(tmp_path)), SharedLedger(str(tmp_path))
    handle = issuing.issue_handle("decode-0", "r1", [1, 2, 3, 4], kv_port=5600, expires=10.0)

    first = reading.read_handle(json.loads(json.dumps(handle)), now=9.0)
    assert (first.held, first.problem, first.again) == ([1, 2, 3, 4], None, False)
    assert reading.read_handle(handle, now=9.0).again
    assert reading.read_handle(handle, now=11.0).problem == "the handle's blocks expired on decode"
    assert issuing.read_handle(dict(handle, remote_request_id="x"), 0).problem is not None


def test_the_shell_fakes_take_the_bidirectional_options() -> None:
    parse = fakes_command.arguments().parse_args
    options = fakes_command.fake_options(
        parse(
            [
                "--bidirectional",
                "--decoder-blocks-ttl",
                "30",
                "--streams-handle",
                "--kv-load-failure-policy",
                "recompute",
                "--kv-recompute-threshold",
                "64",
            ]
        )
    )
    fake = FakeVLLM(**options)
    assert (fake.bidirectional, fake.decoder_blocks_ttl, fake.streams_handle) == (True, 30, True)
    assert (fake.kv_load_failure_policy, fake.kv_recompute_threshold) == ("recompute", 64)
    assert fakes_command.fake_options(parse([]))["bidirectional"] is False


def test_an_unknown_failure_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="fail or recompute"):
        FakeVLLM(kv_load_failure_policy="retry")
