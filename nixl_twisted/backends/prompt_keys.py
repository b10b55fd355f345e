"""What a completion offers its pool's policy to route on (``Routing``), read from the value.

The conversation key (``Rendered.key``: the part of a prompt every turn
repeats), the whole prompt as chained pieces for cache-aware's memory of
prefixes sent, a token-id prompt's ids for kv-aware, and the session key;
each worked out only when a policy in use looks at it, from the prompt the
completion rendered once (``protocol.prompts.render``).
"""

from __future__ import annotations

from collections.abc import Collection

from nixl_twisted.backends.prefixes import pieces
from nixl_twisted.backends.routing import NO_ROUTING, Routing
from nixl_twisted.protocol.completion import Completion


def routing_for(
    policies: Collection[str], key_bytes: int, session: bytes | None, completion: Completion
) -> Routing:
    """What ``completion`` is routed on, worked out only if one of the ``policies`` in use looks.

    ``session`` is the request's ``X-Session-Id``; ``key_bytes`` the
    completion prompt bytes that key a conversation (``--cache-key-bytes``).
    Only instances that serve the completion's model are candidates.
    """
    model = completion.served
    if not {"cache-aware", "kv-aware", "session"} & set(policies):
        return NO_ROUTING if model is None else Routing(model=model)
    if "cache-aware" not in policies and "kv-aware" not in policies:
        return Routing(session=session_key(session, completion), model=model)
    rendered = completion.rendered
    return Routing(
        prompt=rendered.key(key_bytes),
        session=session_key(session, completion) if "session" in policies else None,
        chain=pieces(rendered.text) if rendered.text else (),
        prompt_bytes=len(rendered.text),
        tokens=rendered.ids,  # (a token-id prompt needs no render)
        model=model,
    )


def session_key(header: bytes | None, completion: Completion) -> str | None:
    """``X-Session-ID``, else the body's ``user``."""
    if header:
        return header.decode("utf-8", "replace")
    return completion.user
