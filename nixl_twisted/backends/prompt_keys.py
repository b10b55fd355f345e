"""What a request offers its pool's policy to route on (``Routing``), read from its body.

The conversation key (``prompt_key``: the part of a prompt every turn
repeats), the whole prompt as text for cache-aware's memory of prefixes
sent (``prompt_text``), a token-id prompt's ids for kv-aware, and the
session key; each worked out only when a policy in use looks at it.
"""

from __future__ import annotations

from collections.abc import Collection

from nixl_twisted.backends.prefixes import pieces
from nixl_twisted.backends.routing import NO_ROUTING, Routing
from nixl_twisted.protocol.lowering import JSONObject

#: The most of a chat's leading messages that the key keeps.
CHAT_KEY_LIMIT = 64 * 1024


def prompt_key(body: JSONObject, completion_bytes: int) -> bytes | None:
    """The leading part of a prompt that every later turn of its conversation repeats.

    Chat: the messages rendered (role, then text) up to the end of the
    first user message, so that conversations sharing a system prompt still
    differ (at most ``CHAT_KEY_LIMIT`` bytes). A completion, whose prompt
    only grows: its first ``completion_bytes`` bytes (a prompt shorter than
    that fills no cache block worth finding again).
    """
    limit = CHAT_KEY_LIMIT
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[bytes] = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            parts.append(_utf8(f"{_text(message.get('role'))}\n{_text(message.get('content'))}\n"))
            if message.get("role") == "user":
                break
        rendered = b"".join(parts)
        return rendered[:limit] if rendered else None
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return _utf8(prompt)[:completion_bytes]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        # Token ids: about four bytes of text each.
        return b",".join(str(t).encode() for t in prompt[: max(1, completion_bytes // 4)])
    return None


def prompt_text(body: JSONObject) -> bytes:
    """The whole prompt as text, rendered as ``prompt_key`` renders its start (b"": none).

    Chat: every message, role then text. A completion: its prompt; token
    ids as four bytes each, so a piece is 64 of them.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        return b"".join(
            _utf8(f"{_text(m.get('role'))}\n{_text(m.get('content'))}\n")
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _utf8(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return b"".join((t & 0xFFFFFFFF).to_bytes(4, "big") for t in prompt)
    return b""


def _utf8(text: str) -> bytes:
    """A key's bytes; a lone surrogate (valid as a JSON escape, not as UTF-8) kept as is."""
    return text.encode("utf-8", "surrogatepass")


def _text(content: object) -> str:
    """The text of a message's field: a string, or its text parts; anything else adds none."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return "".join(text for text in texts if isinstance(text, str))
    return ""


def routing_for(
    policies: Collection[str],
    key_bytes: int,
    session: bytes | None,
    body: JSONObject,
    model: str | None = None,
) -> Routing:
    """What a request is routed on, worked out only if one of the ``policies`` in use looks.

    ``session`` is the request's ``X-Session-Id``; ``key_bytes`` the
    completion prompt bytes that key a conversation (``--cache-key-bytes``);
    ``model`` the one its instances must serve (None: any).
    """
    if not {"cache-aware", "kv-aware", "session"} & set(policies):
        return NO_ROUTING if model is None else Routing(model=model)
    if "cache-aware" not in policies and "kv-aware" not in policies:
        return Routing(session=session_key(session, body), model=model)
    rendered = prompt_text(body)
    prompt = body.get("prompt")
    ids = (
        tuple(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        else None
    )
    return Routing(
        prompt=prompt_key(body, key_bytes),
        session=session_key(session, body) if "session" in policies else None,
        chain=pieces(rendered) if rendered else (),
        prompt_bytes=len(rendered),
        tokens=ids,  # (a token-id prompt needs no render)
        model=model,
    )


def session_key(header: bytes | None, body: JSONObject) -> str | None:
    if header:
        return header.decode("utf-8", "replace")
    user = body.get("user")
    return user if isinstance(user, str) and user else None
