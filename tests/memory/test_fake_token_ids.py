"""The fakes answer the prompt's token ids when asked and take them back on decode, as vLLM."""

from __future__ import annotations

from typing import Any

from treq.testing import StubTreq

from nixl_twisted.testing import FakeVLLM, TransferLedger
from nixl_twisted.testing.prefix_cache import prompt_tokens
from tests.memory.test_fakes import post

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
ASK_PREFILL = {"do_remote_decode": True}


def pair() -> tuple[FakeVLLM, FakeVLLM, StubTreq, StubTreq]:
    ledger = TransferLedger()
    prefill, decode = FakeVLLM(name="p", ledger=ledger), FakeVLLM(name="d", ledger=ledger)
    return prefill, decode, StubTreq(prefill.resource()), StubTreq(decode.resource())


def test_a_chat_answers_its_prompts_ids_at_the_top_only_when_asked() -> None:
    _, _, to_prefill, _ = pair()
    _, asked = post(to_prefill, "http://p/v1/chat/completions", dict(CHAT, return_token_ids=True))
    _, plain = post(to_prefill, "http://p/v1/chat/completions", CHAT)

    assert asked["prompt_token_ids"] == prompt_tokens(CHAT)
    assert plain["prompt_token_ids"] is None  # (vLLM's null when not asked)


def test_a_text_completion_answers_its_prompts_ids_in_its_choice() -> None:
    _, _, to_prefill, _ = pair()
    body = {"model": "m", "prompt": [5, 6, 7], "return_token_ids": True}
    _, answer = post(to_prefill, "http://p/v1/completions", body)

    assert answer["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert "prompt_token_ids" not in answer


def handoff(
    to_prefill: StubTreq, to_decode: StubTreq, body: dict[str, Any], ids: object
) -> tuple[int, Any]:
    """A prefill leg, then a decode leg whose params carry ``ids`` as ``prompt_token_ids``."""
    _, answer = post(
        to_prefill, "http://p/v1/chat/completions", dict(body, kv_transfer_params=ASK_PREFILL)
    )
    params = dict(answer["kv_transfer_params"], prompt_token_ids=ids)
    return post(to_decode, "http://d/v1/chat/completions", dict(body, kv_transfer_params=params))


def test_decode_takes_the_handed_ids_and_redeems_the_params_without_them() -> None:
    prefill, decode, to_prefill, to_decode = pair()
    status, _ = handoff(to_prefill, to_decode, CHAT, [1, 2, 3])

    assert status == 200  # (the ledger saw the params as prefill issued them)
    assert decode.token_ids_reused == 1
    assert [r.handed_token_ids for r in decode.requests] == [[1, 2, 3]]
    assert prefill.requests[0].handed_token_ids is None


def test_decode_ignores_the_ids_where_it_must_render_the_messages() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    media = {"model": "m", "messages": [{"role": "user", "content": [image]}]}
    # vLLM 0.34 also renders a message whose reasoning is prompt embeddings:
    embedded = {"role": "assistant", "content": "ok", "reasoning": {"type": "prompt_embeds"}}
    reasoning = {"model": "m", "messages": [embedded]}
    for body in (dict(CHAT, echo=True), media, reasoning):
        _, decode, to_prefill, to_decode = pair()
        status, _ = handoff(to_prefill, to_decode, body, [1, 2, 3])
        assert (status, decode.token_ids_reused) == (200, 0)


def test_decode_refuses_ids_vllm_cannot_take_with_400() -> None:
    for ids in ([], [1, -2], [1, True], "1 2"):
        _, decode, to_prefill, to_decode = pair()
        status, answer = handoff(to_prefill, to_decode, CHAT, ids)
        assert status == 400, ids
        assert "prompt_token_ids" in answer["error"]["message"]
        assert decode.token_ids_reused == 0
