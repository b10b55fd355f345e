"""How long a request's prompt is, estimated without a tokenizer (``measure``).

The decide rules (``nixl_twisted.exchange.decide``) compare its estimate
with their thresholds; a tenant's tokens per minute charge it, media parts
included (``Measured.charged``, ``charges``). A token-id prompt is counted
exactly; text is counted as its UTF-8 bytes over ``BYTES_PER_TOKEN``, about
what vLLM's tokenizers give on English (three to five bytes a token; fewer
bytes on code, more on CJK text, where each character is three bytes and
about a token). The chat template's own tokens are not counted: the
estimate errs short by a few.
"""

from __future__ import annotations

from dataclasses import dataclass
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
#: (``Measured.charged``): about a 1024x1024 image for many vision
#: encoders (576 to 4,096 for the common ones); more in vLLM's usage is
#: charged when the answer ends.
MEDIA_PART_TOKENS = 1024
#: Fields that bring in turns the body does not show (the Responses API's).
_STORED_TURNS = ("previous_response_id", "conversation")


@dataclass(frozen=True)
class Measured:
    """A prompt as the proxy measures it: its text in tokens, its media parts, and whether
    some of it is not in the body (stored turns it continues, or no prompt field at all)."""

    tokens: int
    media: int = 0
    hidden: bool = False

    @property
    def estimate(self) -> int | None:
        """The prompt's tokens, estimated; None when its length is not in its bytes (a
        media part, stored turns)."""
        return None if self.media or self.hidden else self.tokens

    @property
    def charged(self) -> int:
        """The prompt's tokens as a tenant is charged them before vLLM says: its text, and
        ``MEDIA_PART_TOKENS`` for each media part (stored turns are vLLM's usage to say)."""
        return self.tokens + self.media * MEDIA_PART_TOKENS


#: A body with no prompt field the proxy can measure.
UNMEASURED = Measured(0, hidden=True)


def measure(path: str, body: dict[str, Any]) -> Measured:
    """The prompt of ``body`` on ``path`` (``Completion.measured`` asks once a request).

    Every string in the route's prompt fields counts (message text, tool
    definitions). A body with no prompt field is ``UNMEASURED``: no estimate,
    nothing charged for its prompt.
    """
    stored = any(body.get(name) is not None for name in _STORED_TURNS)
    prompt = body.get("prompt")
    if path == routes.COMPLETIONS and isinstance(prompt, list) and _token_ids(prompt):
        return Measured(len(prompt), 0, stored)
    texts = [body[name] for name in PROMPT_FIELDS.get(path, ()) if name in body]
    if not any(_has_text(value) for value in texts):
        return UNMEASURED
    size = media = 0
    for value in texts:
        more, parts = _text_bytes(value)
        size, media = size + more, media + parts
    return Measured(-(-size // BYTES_PER_TOKEN), media, stored)


def estimate_tokens(path: str, body: dict[str, Any]) -> int | None:
    """The prompt's tokens, estimated; None when the body holds no prompt the proxy can measure.

    A prompt with an image, audio, video or file part, or one that continues
    stored turns, has none: its length is not in its bytes.
    """
    return measure(path, body).estimate


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


#: The most of a chat's leading messages that a conversation's key keeps.
CHAT_KEY_LIMIT = 64 * 1024


@dataclass(frozen=True)
class Rendered:
    """A prompt as text, rendered once (``render``) for the routing policies.

    ``text``: every message, role then text, or a completion's prompt (token
    ids as four bytes each); ``opening``: how much of it a chat's first turn
    takes (up to the end of its first user message), or None for a
    completion; ``ids``: a prompt of token ids, as given.
    """

    text: bytes = b""
    opening: int | None = None
    ids: tuple[int, ...] | None = None

    def key(self, completion_bytes: int) -> bytes | None:
        """The leading part of the prompt that every later turn of its conversation repeats.

        Chat: its messages up to the end of the first user message, so that
        conversations sharing a system prompt still differ (at most
        ``CHAT_KEY_LIMIT`` bytes). A completion, whose prompt only grows: its
        first ``completion_bytes`` bytes (a prompt shorter than that fills no
        cache block worth finding again); token ids as decimal text.
        """
        if self.opening is not None:
            return self.text[: min(self.opening, CHAT_KEY_LIMIT)] or None
        if self.ids:
            # Token ids: about four bytes of text each.
            kept = self.ids[: max(1, completion_bytes // 4)]
            return b",".join(str(t).encode() for t in kept)
        return self.text[:completion_bytes] or None


def render(body: dict[str, Any]) -> Rendered:
    """``body``'s prompt as ``Rendered``: a chat's messages in one pass, a completion's prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[bytes] = []
        opening: int | None = None
        size = 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            part = _utf8(f"{_text(message.get('role'))}\n{_text(message.get('content'))}\n")
            parts.append(part)
            size += len(part)
            if opening is None and message.get("role") == "user":
                opening = size
        text = b"".join(parts)
        return Rendered(text, size if opening is None else opening)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return Rendered(_utf8(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = tuple(prompt)
        text = b"".join((t & 0xFFFFFFFF).to_bytes(4, "big") for t in ids)
        return Rendered(text, None, ids or None)
    return Rendered()


def _utf8(text: str) -> bytes:
    """A prompt's bytes; a lone surrogate (valid as a JSON escape, not as UTF-8) kept as is."""
    return text.encode("utf-8", "surrogatepass")


def _text(content: object) -> str:
    """The text of a message's field: a string, or its text parts; anything else adds none."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return "".join(text for text in texts if isinstance(text, str))
    return ""
