"""The prompt's token ids asked of prefill and handed to decode, as pure functions."""

from __future__ import annotations

import json

import pytest

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.token_ids import asking, handed, prompt_ids, text_only, used_by_decode

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PARAMS = {"do_remote_prefill": True, "remote_request_id": "r-1"}


def part(**fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": [fields]}]}


def test_decode_uses_the_ids_of_a_text_chat_only() -> None:
    assert used_by_decode(routes.CHAT_COMPLETIONS, CHAT)
    assert used_by_decode(routes.CHAT_COMPLETIONS, part(type="text", text="hi"))
    assert used_by_decode(routes.CHAT_COMPLETIONS, part(text="hi"))  # (type defaults to text)
    assert used_by_decode(routes.CHAT_COMPLETIONS, dict(CHAT, echo=False))
    # vLLM renders these itself and ignores handed ids:
    assert not used_by_decode(routes.CHAT_COMPLETIONS, dict(CHAT, echo=True))
    assert not used_by_decode(routes.CHAT_COMPLETIONS, part(type="image_url", image_url={}))
    assert not used_by_decode(routes.CHAT_COMPLETIONS, part(type="text", input_audio={}))
    assert not used_by_decode(routes.CHAT_COMPLETIONS, part(type="file"))
    assert not used_by_decode(routes.CHAT_COMPLETIONS, part(type=3))
    # vLLM 0.34 (``has_non_text_content``) also renders reasoning given as embeddings:
    for field in ("reasoning", "reasoning_content"):
        embedded = {"role": "assistant", "content": "ok", field: {"type": "prompt_embeds"}}
        assert not used_by_decode(routes.CHAT_COMPLETIONS, dict(CHAT, messages=[embedded]))
        as_text = dict(embedded, **{field: "thought about it"})
        assert used_by_decode(routes.CHAT_COMPLETIONS, dict(CHAT, messages=[as_text]))
    # Routes whose prefill answers none, or whose decode never looks:
    for path in (routes.COMPLETIONS, routes.RESPONSES, routes.MESSAGES):
        assert not used_by_decode(path, CHAT)


def test_content_that_is_text_in_every_form_vllm_knows() -> None:
    for kind in ("text", "input_text", "output_text", "refusal", "thinking", "tool_reference"):
        assert text_only([{"role": "user", "content": [{"type": kind}]}]), kind
    assert text_only(None)
    assert text_only([{"role": "user", "content": None}, "not a message"])


def test_the_prefill_body_asks_and_the_completion_asks_only_when_told() -> None:
    assert asking({"model": "m"}) == {"model": "m", "return_token_ids": True}
    completion = Completion(routes.CHAT_COMPLETIONS, CHAT, "r")
    assert completion.hands_token_ids
    assert json.loads(completion.prefill_bytes(True))["return_token_ids"] is True
    assert "return_token_ids" not in json.loads(completion.prefill_bytes())
    client_asked = Completion(routes.CHAT_COMPLETIONS, dict(CHAT, return_token_ids=True), "r")
    assert json.loads(client_asked.prefill_bytes())["return_token_ids"] is True


def test_the_ids_prefill_answered_are_added_to_its_params() -> None:
    answer = {"prompt_token_ids": [3, 0, 7], "kv_transfer_params": PARAMS}
    assert handed(PARAMS, answer) == dict(PARAMS, prompt_token_ids=[3, 0, 7])
    assert "prompt_token_ids" not in PARAMS  # (a new value: prefill's params are not changed)


@pytest.mark.parametrize("ids", [None, [], [1, -1], [1, True], [1, 2.0], "1 2", {"0": 1}], ids=repr)
def test_ids_decode_would_refuse_are_not_handed(ids: object) -> None:
    answer = {"prompt_token_ids": ids, "kv_transfer_params": PARAMS}
    assert prompt_ids(answer) is None
    assert handed(PARAMS, answer) is PARAMS


def test_an_answer_without_ids_leaves_the_params_as_they_were() -> None:
    assert handed(PARAMS, {"kv_transfer_params": PARAMS}) is PARAMS
    assert handed(PARAMS, [1, 2]) is PARAMS
