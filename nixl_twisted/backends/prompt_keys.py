"""What a completion offers its pool's policy to route on (``Routing``), read from the value.

The conversation key (``Rendered.key``: the part of a prompt every turn
repeats), the whole prompt as chained pieces for the memory of prefixes
sent, a token-id prompt's ids for the KV events' index, and the session
key; each worked out only when a policy in use reads it (``policies.Needs``),
from the prompt the completion rendered once (``protocol.prompts.render``). A completion's
``cache_salt`` namespaces every one of them, as it namespaces vLLM's prefix
cache: requests with different salts never share a key, a remembered
prefix or a KV block, so none predicts another's hits.
"""

from __future__ import annotations

from nixl_twisted.backends.policies import Needs
from nixl_twisted.backends.prefixes import pieces
from nixl_twisted.backends.routing import NO_ROUTING, Routing
from nixl_twisted.protocol.completion import Completion


def routing_for(
    needs: Needs, key_bytes: int, session: bytes | None, completion: Completion
) -> Routing:
    """What ``completion`` is routed on, worked out only as far as the policies in use read.

    ``needs``: what they read (``BackendService.needs``); ``session`` is the
    request's ``X-Session-Id``; ``key_bytes`` the completion prompt bytes
    that key a conversation (``--cache-key-bytes``). Only instances that
    serve the completion's model are candidates.
    """
    model = completion.served
    prompt = needs.prompt_text or needs.token_ids
    if not prompt and not needs.session_key:
        return NO_ROUTING if model is None else Routing(model=model)
    if not prompt:
        return Routing(session=session_key(session, completion), model=model)
    rendered = completion.rendered
    salt = completion.salt
    key = rendered.key(key_bytes)
    return Routing(
        prompt=_salted(salt, key) if key is not None else None,
        session=session_key(session, completion) if needs.session_key else None,
        chain=pieces(rendered.text, _salted(salt, b"")) if rendered.text else (),
        prompt_bytes=len(rendered.text),
        tokens=rendered.ids,  # (a token-id prompt needs no render)
        model=model,
        salt=salt,
    )


def session_key(header: bytes | None, completion: Completion) -> str | None:
    """``X-Session-ID``, else the body's ``user`` (within its ``cache_salt``, if any)."""
    if header:
        key: str | None = header.decode("utf-8", "replace")
    else:
        key = completion.user
    if key is None or completion.salt is None:
        return key
    return f"{completion.salt}\0{key}"


def _salted(salt: str | None, key: bytes) -> bytes:
    """``key`` in ``salt``'s namespace (unsalted: as it was); a salt holds no NUL."""
    if salt is None:
        return key
    return b"cache_salt\0" + salt.encode("utf-8", "surrogatepass") + b"\0" + key
