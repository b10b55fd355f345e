"""The prompt's token ids through the proxy: asked of prefill, handed to decode, never to the
client (``docs/protocol.md``, "Token ids handed to decode")."""

from __future__ import annotations

from typing import Any

from nixl_twisted.testing.prefix_cache import prompt_tokens
from tests.memory.support import CHAT, FULL_CHAT, Setup, sse_events


def test_a_chats_prompt_ids_go_from_prefill_to_decode_and_decode_uses_them() -> None:
    setup = Setup()
    answer = setup.post("/v1/chat/completions", FULL_CHAT).answer()

    assert answer.status == 200
    (prefill,) = setup.prefill.requests
    (decode,) = setup.decode.requests
    assert prefill.body is not None and prefill.body["return_token_ids"] is True
    assert decode.handed_token_ids == prompt_tokens(FULL_CHAT)
    assert setup.decode.token_ids_reused == 1
    # The client's answer is as it was: no ids it did not ask for, and decode not asked.
    assert decode.body is not None and "return_token_ids" not in decode.body
    assert answer.json()["prompt_token_ids"] is None
    # Every other key of prefill's params reached decode as issued.
    assert decode.body["kv_transfer_params"] == dict(
        setup.ledger.redeemed[0], prompt_token_ids=prompt_tokens(FULL_CHAT)
    )


def test_a_streamed_chat_hands_the_ids_and_its_chunks_carry_none() -> None:
    setup = Setup()
    events = sse_events(setup.post("/v1/chat/completions", dict(CHAT, stream=True)))

    assert setup.decode.token_ids_reused == 1
    # As vLLM says them when not asked (decode was asked, for a migration's sake).
    chunks = [event for event in events if isinstance(event, dict)]
    assert [event.get("prompt_token_ids") for event in chunks] == [None] * len(chunks)
    assert {choice.get("token_ids") for e in chunks for choice in e["choices"]} == {None}


def test_a_client_that_asked_for_ids_gets_them_from_decode() -> None:
    setup = Setup()
    answer = setup.post("/v1/chat/completions", dict(CHAT, return_token_ids=True)).answer()

    assert answer.json()["prompt_token_ids"] == prompt_tokens(CHAT)
    assert setup.decode.token_ids_reused == 1


def no_ids_asked_or_handed(setup: Setup) -> None:
    (prefill,) = setup.prefill.requests
    (decode,) = setup.decode.requests
    assert prefill.body is not None and "return_token_ids" not in prefill.body
    assert decode.handed_token_ids is None
    assert setup.decode.token_ids_reused == 0


def test_where_decode_would_ignore_them_prefill_is_not_asked() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", dict(CHAT, echo=True)),
        ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": [image]}])),
        ("/v1/completions", {"model": "m", "prompt": "hello there"}),
        ("/v1/messages", dict(CHAT, max_tokens=4)),
        ("/v1/responses", {"model": "m", "input": "hello there"}),
    ]
    for path, body in bodies:
        setup = Setup()
        assert setup.post(path, body).answer().status == 200, path
        no_ids_asked_or_handed(setup)


def test_token_ids_to_decode_off_sends_the_legs_of_protocol_version_1() -> None:
    setup = Setup(token_ids_to_decode=False)
    assert setup.post("/v1/chat/completions", CHAT).answer().status == 200
    no_ids_asked_or_handed(setup)


def test_a_prefill_that_answers_no_ids_leaves_decode_to_tokenize() -> None:
    # An older vLLM ignores return_token_ids: decode is served as before.
    setup = Setup(fake_options={"returns_token_ids": False})
    assert setup.post("/v1/chat/completions", CHAT).answer().status == 200
    (decode,) = setup.decode.requests
    assert decode.handed_token_ids is None
    assert decode.body is not None
    assert decode.body["kv_transfer_params"] == setup.ledger.redeemed[0]
