"""The prompt's token ids as vLLM 0.32-0.34 returns them and takes them back on decode.

Asked ``return_token_ids: true``, a chat completion answers the prompt's ids
in ``prompt_token_ids`` (a stream: in its first chunk), a text completion
in each choice's. A decode leg whose ``kv_transfer_params`` carry
``prompt_token_ids`` has them popped before the engine sees the params,
checked (400 for anything but a non-empty list of non-negative integers)
and fed to the engine instead of the rendered prompt, unless the request
must be rendered (``echo``, content that is not text, or, since 0.34, a
message's reasoning given as prompt embeddings: then they are ignored).
The fake's own rules, written apart from the proxy's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

JSONObject = dict[str, Any]

_TEXT = ("text", "input_text", "output_text", "refusal", "thinking", "tool_reference")
_MEDIA = (
    "image_url",
    "input_image",
    "image_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "video_embeds",
    "prompt_embeds",
)

#: vLLM's 400 for handed ids it cannot take.
MALFORMED = (
    "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers."
)


def asked(body: JSONObject) -> bool:
    """The request asks for token ids in its answer."""
    return body.get("return_token_ids") is True


def _media(messages: object) -> bool:
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and any(
            isinstance(message.get(field), dict) and message[field].get("type") == "prompt_embeds"
            for field in ("reasoning", "reasoning_content")
        ):
            return True
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and (
                part.get("type", "text") not in _TEXT or any(key in part for key in _MEDIA)
            ):
                return True
    return False


@dataclass(frozen=True)
class Handed:
    """What a decode leg's ``kv_transfer_params`` handed over: the params without the ids
    (what the engine, and the ledger, see), and the ids if the request uses them."""

    params: object
    #: The ids the engine takes instead of the rendered prompt (None: none, or ignored).
    used: list[int] | None = None
    #: Why vLLM would answer 400 (None: nothing wrong).
    refusal: str | None = None


def take(kv: object, body: JSONObject, chat: bool) -> Handed:
    """A decode leg's ids popped from its ``kv_transfer_params``, checked, used or ignored
    (vLLM uses them on its chat, Responses and Messages routes; not on text completions)."""
    if not isinstance(kv, dict) or kv.get("prompt_token_ids") is None:
        return Handed(kv)
    ids = kv["prompt_token_ids"]
    params = {key: value for key, value in kv.items() if key != "prompt_token_ids"}
    if not chat or body.get("echo") or _media(body.get("messages")):
        return Handed(params)
    if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
        return Handed(params, refusal=MALFORMED)
    return Handed(params, used=ids)
