"""The prompt's token ids, asked of prefill and handed to decode (``docs/protocol.md``).

vLLM (0.32 and on) answers a chat completion asked ``return_token_ids: true``
with the prompt's ids (``prompt_token_ids``), and a decode leg that carries
them in ``kv_transfer_params.prompt_token_ids`` feeds them to its engine
without rendering the chat template or tokenizing again
(``vllm/renderers/online_renderer.py``, ``_reused_prompt_token_ids``). It
ignores them where it must render (``echo``, content that is not text), so
the proxy asks for them only where decode uses them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.lowering import JSONObject

#: A streamed event's token ids, as vLLM writes them (``return_token_ids``).
LISTED_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')
#: A chat chunk vLLM sends only because token ids were asked (no text, logprobs or end).
EMPTY_DELTA = b'"delta":{},"logprobs":null,"finish_reason":null'

#: vLLM's text content parts (``vllm/renderers/chat_utils.py``: ``_TEXT_CONTENT_PART_TYPES``).
_TEXT_PARTS = frozenset(
    ("text", "input_text", "output_text", "refusal", "thinking", "tool_reference")
)
#: Keys that make a part media whatever its ``type`` (``_MEDIA_CONTENT_PART_KEYS``).
_MEDIA_KEYS = frozenset(
    (
        "audio_embeds",
        "audio_url",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "input_image",
        "prompt_embeds",
        "video_embeds",
        "video_url",
    )
)


#: A message's fields whose ``{"type": "prompt_embeds"}`` vLLM 0.34 also renders itself.
_REASONING_FIELDS = ("reasoning", "reasoning_content")


def _embedded_reasoning(message: dict[str, Any]) -> bool:
    """The message's reasoning is prompt embeddings (vLLM 0.34 renders it, ignoring ids)."""
    for field in _REASONING_FIELDS:
        reasoning = message.get(field)
        if isinstance(reasoning, dict) and reasoning.get("type") == "prompt_embeds":
            return True
    return False


def text_only(messages: object) -> bool:
    """No message has a part vLLM renders as media, nor reasoning given as prompt
    embeddings (``has_non_text_content``, negated: ``renderers/chat_utils.py`` in vLLM
    0.32, ``renderers/chat_utils/chat_message.py`` in 0.34, which added the reasoning)."""
    if not isinstance(messages, list):
        return True
    for message in messages:
        if isinstance(message, dict) and _embedded_reasoning(message):
            return False
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type", "text")
            if not isinstance(kind, str) or kind not in _TEXT_PARTS or _MEDIA_KEYS & part.keys():
                return False
    return True


def used_by_decode(path: str, body: JSONObject) -> bool:
    """Whether decode would use the prompt's ids for this body: a chat completion, text
    only, not echoed (the one route whose prefill answer carries them)."""
    return (
        path == routes.CHAT_COMPLETIONS and not body.get("echo") and text_only(body.get("messages"))
    )


def asking(leg: JSONObject) -> JSONObject:
    """A leg's body that asks for token ids: prefill's answers the prompt's, a decode
    stream's each chunk's (``return_token_ids``)."""
    return dict(leg, return_token_ids=True)


def given(leg: JSONObject, ids: Sequence[int]) -> JSONObject:
    """A leg's body whose prompt is ``ids`` (a continued chat's: its prompt and the tokens
    relayed), in ``kv_transfer_params``, where vLLM's chat renderer takes them on either leg
    and with or without a handoff (its other params kept)."""
    params = leg.get("kv_transfer_params")
    handed = dict(params) if isinstance(params, dict) else {}
    handed["prompt_token_ids"] = list(ids)
    return dict(leg, kv_transfer_params=handed)


def prompt_ids(answer: Any) -> list[int] | None:
    """The ``prompt_token_ids`` of a prefill answer, if they are what decode accepts: a
    non-empty list of non-negative integers (vLLM answers 400 to anything else)."""
    return listed(answer.get("prompt_token_ids") if isinstance(answer, dict) else None)


def listed(ids: object) -> list[int] | None:
    """``ids`` if they are a non-empty list of non-negative integers (None: not)."""
    if not isinstance(ids, list) or not ids:
        return None
    if any(type(token) is not int or token < 0 for token in ids):
        return None
    return ids


def answered_prompt(answer: Any) -> list[int] | None:
    """The prompt's ids a prefill answer asked ``return_token_ids`` says: a chat's at its
    top, a text completion's in its choice (None: not said, or not ids)."""
    ids = prompt_ids(answer)
    if ids is not None or not isinstance(answer, dict):
        return ids
    choices = answer.get("choices")
    if isinstance(choices, list) and len(choices) == 1:
        return prompt_ids(choices[0])
    return None


def handed(params: JSONObject, answer: Any) -> JSONObject:
    """Prefill's ``kv_transfer_params`` with the prompt's ids prefill answered, for decode.

    ``answer`` is prefill's answer as parsed for its params. Without ids (a
    vLLM that does not return them) they are as they were: decode then
    renders and tokenizes the prompt itself.
    """
    ids = prompt_ids(answer)
    return params if ids is None else dict(params, prompt_token_ids=ids)
