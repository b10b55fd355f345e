"""What the migration tests share: the routes' bodies, an uninterrupted answer, and the
comparison that holds a moved answer to it token for token."""

from __future__ import annotations

from typing import Any

from tests.memory.support import Setup
from tests.support import assert_same_answer

__all__ = ["assert_same_answer"]

#: Tokens every fake answers, at most its request's max.
TOKENS = 6
MESSAGES = [{"role": "user", "content": "What does decode pull over NIXL, and from where?"}]
#: Each two-leg route's streamed body (its usage asked where the route has it asked).
STREAMS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "fake-model",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    },
    "/v1/completions": {
        "model": "fake-model",
        "prompt": "What does decode pull over NIXL, and from where?",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 16,
    },
    "/v1/responses": {"model": "fake-model", "input": "What does decode pull?", "stream": True},
    "/v1/messages": {"model": "fake-model", "max_tokens": 16, "messages": MESSAGES, "stream": True},
}
#: Events of each route's stream before its first token.
OPENING = {
    "/v1/chat/completions": 1,
    "/v1/completions": 0,
    "/v1/responses": 4,
    "/v1/messages": 2,
}
TRACKED = ("/v1/chat/completions", "/v1/completions")


def whole(path: str) -> dict[str, Any]:
    """The route's body, not streamed."""
    return {key: value for key, value in STREAMS[path].items() if key != "stream_options"} | {
        "stream": False
    }


def uninterrupted(path: str, body: dict[str, Any], **settings: Any) -> bytes:
    """The answer a proxy gives ``body`` when no decode instance fails."""
    setup = Setup(tokens=TOKENS, **settings)
    answer = setup.post(path, body).answer()
    assert answer.status == 200 and answer.complete
    return answer.body


def done_count(body: bytes) -> int:
    return body.count(b"data: [DONE]")
