"""What the fake refuses with 400, as vLLM's request validation does before any engine work.

vLLM checks each request against its schema (pydantic) and answers a bad
one 400 with an OpenAI error body. The fake checks the fields it reads, by
their JSON types, so that a test sending arbitrary values sees what a proxy
does with vLLM's 400, not a crash of the fake. (vLLM coerces some values the
fake refuses, ``"stream": "false"`` among them; a proxy relays either answer.)
"""

from __future__ import annotations

from typing import Any

JSONObject = dict[str, Any]

_INTEGERS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "n")
_FLAGS = ("stream", "store", "background")
_REQUIRED = {
    "/v1/completions": "prompt",
    "/v1/chat/completions": "messages",
    "/v1/messages": "messages",
    "/v1/responses": "input",
}


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(value: object) -> bool:
    if not isinstance(value, list):
        return False
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return False
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            return False
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            return False
    return True


def _prompt(value: object) -> bool:
    """A string, token ids, or a list of either (a batch)."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    if all(_integer(t) for t in value):
        return True
    return all(
        isinstance(p, str) or (isinstance(p, list) and p and all(_integer(t) for t in p))
        for p in value
    )


def refusal(path: str, body: JSONObject) -> str | None:
    """Why vLLM would answer this body 400, or None when the fake can serve it."""
    required = _REQUIRED.get(path)
    if required is not None and required not in body:
        return f"Field required: {required}"
    if not isinstance(body.get("model", ""), str | type(None)):
        return "model: Input should be a valid string"
    for name in _INTEGERS:
        value = body.get(name)
        if value is not None and (not _integer(value) or value < (1 if name == "n" else 0)):
            return f"{name}: Input should be a valid integer"
    for name in _FLAGS:
        if not isinstance(body.get(name, False), bool | type(None)):
            return f"{name}: Input should be a valid boolean"
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or not isinstance(options.get("include_usage", False), bool | type(None))
    ):
        return "stream_options: Input should be a valid dictionary"
    if "messages" in body and not _messages(body["messages"]):
        return "messages: Input should be a valid list of messages"
    if path == "/v1/completions" and not _prompt(body.get("prompt")):
        return "prompt: Input should be a string, a list of token ids, or a list of either"
    if path == "/v1/responses" and not isinstance(body.get("input"), str | list):
        return "input: Input should be a valid string or list"
    return None
