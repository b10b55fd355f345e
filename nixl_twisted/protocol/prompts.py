"""How long a request's prompt is, estimated without a tokenizer (``estimate_tokens``).

The decide rules (``nixl_twisted.exchange.decide``) compare it with their
thresholds; a tenant's tokens per minute charge it, media parts included
(``charged_prompt_tokens``, ``charges``). A token-id prompt is counted
exactly; text is counted as its UTF-8 bytes over ``BYTES_PER_TOKEN``, about
what vLLM's tokenizers give on English (three to five bytes a token; fewer
bytes on code, more on CJK text, where each character is three bytes and
about a token). The chat template's own tokens are not counted: the
estimate errs short by a few.
"""

from __future__ import annotations

from typing import Any

from nixl_twisted.protocol import routes

#: Bytes of UTF-8 text per estimated token.
BYTES_PER_TOKEN = 4

#: The fields of each two-leg route that the engine renders into the prompt.
PROMPT_FIELDS: dict[str, tuple[str, ...]] = {
    routes.COMPLETIONS: ("prompt",),
    routes.CHAT_COMPLETIONS: ("messages", "tools"),
    routes.RESPONSES: ("input", "instructions", "tools"),
    routes.MESSAGES: ("system", "messages", "tools"),
}


#: Content parts whose tokens the model's encoder decides (hundreds or thousands an
#: image): a prompt holding one has no estimate, so no rule skips its prefill.
MEDIA_PARTS = frozenset(
    {
        "image_url",
        "image",
        "input_image",
        "input_audio",
        "audio_url",
        "video_url",
        "file",
        "input_file",
        "document",
    }
)
#: The tokens a media part is charged to its tenant before vLLM's usage says
#: (``charged_prompt_tokens``): about a 1024x1024 image for many vision
#: encoders (576 to 4,096 for the common ones); more in vLLM's usage is
#: charged when the answer ends.
MEDIA_PART_TOKENS = 1024
#: Fields that bring in turns the body does not show (the Responses API's).
_STORED_TURNS = ("previous_response_id", "conversation")


def estimate_tokens(path: str, body: dict[str, Any]) -> int | None:
    """The prompt's tokens, estimated; None when the body holds no prompt the proxy can measure.

    Every string in the route's prompt fields counts (message text, tool
    definitions). A prompt with an image, audio, video or file part, or one
    that continues stored turns, has none: its length is not in its bytes.
    """
    if any(body.get(name) is not None for name in _STORED_TURNS):
        return None
    measured = _measure(path, body)
    if measured is None or measured[1]:
        return None
    return measured[0]


def charged_prompt_tokens(path: str, body: dict[str, Any]) -> int:
    """The prompt's tokens as a tenant is charged them before vLLM says: its text
    estimated as ``estimate_tokens`` does, and ``MEDIA_PART_TOKENS`` for each media part.

    Stored turns the body does not show are not counted: vLLM's usage, which
    replaces the charge when the answer ends, counts them.
    """
    measured = _measure(path, body)
    if measured is None:
        return 0
    tokens, media = measured
    return tokens + media * MEDIA_PART_TOKENS


def _measure(path: str, body: dict[str, Any]) -> tuple[int, int] | None:
    """The prompt's text tokens and its media parts; None when it has no prompt field."""
    prompt = body.get("prompt")
    if path == routes.COMPLETIONS and isinstance(prompt, list) and _token_ids(prompt):
        return len(prompt), 0
    texts = [body[name] for name in PROMPT_FIELDS.get(path, ()) if name in body]
    if not any(_has_text(value) for value in texts):
        return None
    size = media = 0
    for value in texts:
        more, parts = _text_bytes(value)
        size, media = size + more, media + parts
    return -(-size // BYTES_PER_TOKEN), media


def _token_ids(prompt: list[Any]) -> bool:
    return bool(prompt) and all(type(t) is int for t in prompt)


def _has_text(value: object) -> bool:
    return isinstance(value, str | list | dict) and bool(value)


def _text_bytes(value: object) -> tuple[int, int]:
    """The UTF-8 bytes of every string in ``value`` (keys aside), and its media parts.

    A token id counts as a token. A media part's own strings (a URL, base64
    data) are not its tokens: the encoder's are, so it is counted apart.

    Walked with a stack, not recursion: a body nested as deep as the JSON
    parser allowed must not overflow Python's stack here.
    """
    size = media = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            size += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            if item.get("type") in MEDIA_PARTS:
                media += 1
                continue
            pending.extend(item.values())
        elif type(item) is int:
            size += BYTES_PER_TOKEN
    return size, media
