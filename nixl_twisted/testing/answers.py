"""What vLLM answers look like: OpenAI completions, chat completions, their streams, errors.

Encoded compact, as vLLM's pydantic models are (``model_dump_json``); the
fields vLLM sets to null when not asked (``token_ids``, ``prompt_token_ids``)
are there as null. A generated token's id says its place in the answer
(``FIRST_GENERATED`` plus its index), so that an answer continued from a
prompt that ends with some of them goes on from there, as a model would.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

JSONObject = dict[str, Any]
#: A stream's event, or what makes it when it is written (one that carries a handle).
Event = bytes | Callable[[], bytes]


#: The id of an answer's first generated token; the next ones follow it. Beyond any id
#: of a prompt's text (four bytes each, ``prefix_cache.text_tokens``).
FIRST_GENERATED = 1 << 40


def encode(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def generated_ids(start: int, count: int) -> list[int]:
    """The ids of the tokens at places ``start`` to ``start + count`` of an answer."""
    return list(range(FIRST_GENERATED + start, FIRST_GENERATED + start + count))


def resumed_at(prompt: list[int]) -> int:
    """Where an answer whose prompt is ``prompt`` goes on from: after the generated tokens
    the prompt ends with (0: a prompt of the client's own)."""
    last = prompt[-1] if prompt else 0
    return last - FIRST_GENERATED + 1 if last >= FIRST_GENERATED else 0


def vllm_error(status: int, message: str, kind: str | None = None) -> bytes:
    """vLLM's error body: OpenAI's, with the status as ``code`` (``kind``: its ``type``,
    when not the one vLLM gives most errors of that status)."""
    if kind is None:
        kind = "BadRequestError" if status < 500 else "InternalServerError"
    return encode({"error": {"message": message, "type": kind, "param": None, "code": status}})


def models(
    model: str, adapters: Sequence[str] = (), created: int = 0, max_model_len: int = 1024
) -> bytes:
    """``GET /v1/models``: the base model with its context (``max_model_len``), then each
    LoRA adapter (its ``parent``, no context of its own); each card ``created`` when
    asked, as vLLM's are."""
    card = {"object": "model", "created": created, "owned_by": "vllm"}
    cards = [{"id": model, **card, "root": model, "parent": None, "max_model_len": max_model_len}]
    for adapter in adapters:
        cards.append({"id": adapter, **card, "root": f"/adapters/{adapter}", "parent": model})
    return encode({"object": "list", "data": cards})


@dataclass
class Answer:
    """One generated answer, whole (JSON) or as the SSE events of a stream."""

    chat: bool
    model: str
    words: list[str]
    finish_reason: str
    usage: JSONObject
    #: Asked ``return_token_ids``: the prompt's ids, answered as vLLM answers them
    #: (a chat's at the top, a text completion's in its choice; a stream's first chunk).
    prompt_token_ids: list[int] | None = None
    #: Asked ``return_token_ids``: the ids of ``words``, one each (a stream's in each chunk).
    token_ids: list[int] | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def whole(self) -> JSONObject:
        text = "".join(self.words)
        if self.chat:
            choice: JSONObject = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": self.finish_reason,
            }
            kind = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": self.finish_reason,
                "prompt_token_ids": None,
            }
            kind = "text_completion"
        choice["token_ids"] = self.token_ids
        whole = {
            "id": self._prefixed_id(),
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }
        return self._with_ids(whole, choice)

    def _with_ids(self, event: JSONObject, choice: JSONObject) -> JSONObject:
        (event if self.chat else choice)["prompt_token_ids"] = self.prompt_token_ids
        return event

    def _prefixed_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def _chunk(
        self,
        choice: JSONObject,
        usage: JSONObject | None = None,
        first: bool = False,
        kv: JSONObject | None = None,
    ) -> bytes:
        event: JSONObject = {
            "id": self._prefixed_id(),
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if usage is not None:
            event["usage"] = usage
        if first:
            self._with_ids(event, choice)
        if kv is not None:
            event["kv_transfer_params"] = kv
        return b"data: " + encode(event) + b"\n\n"

    def _handing(self, choice: JSONObject, first: bool, handle: Callable[[], JSONObject]) -> bytes:
        return self._chunk(choice, first=first, kv=handle())

    def events(
        self, include_usage: bool, handle: Callable[[], JSONObject] | None = None
    ) -> list[Event]:
        """The stream's events; ``handle``: what the chunk that carries ``finish_reason``
        says as its ``kv_transfer_params``, made when it is written (vLLM 0.33+)."""
        events: list[Event] = []
        if self.chat:
            events.append(
                self._chunk(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    },
                    first=True,
                )
            )
        for index, word in enumerate(self.words):
            last = index == len(self.words) - 1
            finish = self.finish_reason if last else None
            ids = None if self.token_ids is None else [self.token_ids[index]]
            if self.chat:
                choice: JSONObject = {
                    "index": 0,
                    "delta": {"content": word},
                    "logprobs": None,
                    "finish_reason": finish,
                    "token_ids": ids,
                }
            else:
                choice = {
                    "index": 0,
                    "text": word,
                    "logprobs": None,
                    "finish_reason": finish,
                    "prompt_token_ids": None,
                    "token_ids": ids,
                }
            first = not self.chat and index == 0
            if last and handle is not None:
                events.append(partial(self._handing, choice, first, handle))
            else:
                events.append(self._chunk(choice, first=first))
        if include_usage:
            events.append(self._chunk({}, self.usage))
        events.append(b"data: [DONE]\n\n")
        return events


def prompt_tokens(body: JSONObject, chat: bool) -> int:
    """The prompt's length in tokens, a token being a word here."""
    if chat:
        text = " ".join(
            str(m.get("content", "")) for m in body.get("messages", []) if isinstance(m, dict)
        )
    else:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        text = json.dumps(prompt) if not isinstance(prompt, str) else prompt
    return max(1, len(text.split()))


def words(text: str, count: int, start: int = 0) -> list[str]:
    """``count`` tokens of ``text`` from its ``start``-th, from its start again when it
    runs out: the token at each place of an answer is always the same."""
    pieces = text.split()
    return [pieces[i % len(pieces)] + " " for i in range(start, start + count)]


def _sse(event: str, data: JSONObject) -> bytes:
    return f"event: {event}\ndata: ".encode() + encode(data) + b"\n\n"


@dataclass
class Message:
    """One Anthropic Messages answer, as vLLM gives it: whole, or its typed SSE events."""

    model: str
    words: list[str]
    stop_reason: str
    input_tokens: int
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)

    def whole(self) -> JSONObject:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": "".join(self.words)}],
            "stop_reason": self.stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": len(self.words)},
        }

    def events(self) -> list[bytes]:
        start = dict(self.whole(), content=[], stop_reason=None)
        start["usage"] = {"input_tokens": self.input_tokens, "output_tokens": 0}
        return [
            _sse("message_start", {"type": "message_start", "message": start}),
            _sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            *(
                _sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": word},
                    },
                )
                for word in self.words
            ),
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": len(self.words)},
                },
            ),
            _sse("message_stop", {"type": "message_stop"}),
        ]


@dataclass
class Response:
    """One OpenAI Responses API answer, as vLLM gives it: whole, or its typed SSE events."""

    model: str
    words: list[str]
    input_tokens: int
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    item: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def whole(self, status: str = "completed") -> JSONObject:
        text = "".join(self.words)
        done = status == "completed"
        content = [{"type": "output_text", "text": text, "annotations": []}] if done else []
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": [
                {
                    "type": "message",
                    "id": self.item,
                    "role": "assistant",
                    "status": status,
                    "content": content,
                }
            ]
            if done
            else [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": self.input_tokens,
                "output_tokens": len(self.words),
                "total_tokens": self.input_tokens + len(self.words),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    def events(self, handle: Callable[[], JSONObject] | None = None) -> list[Event]:
        """The typed events; ``handle``: the ``kv_transfer_params`` of the response in
        ``response.completed``, made when it is written."""
        item = {
            "type": "message",
            "id": self.item,
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": []}
        text = "".join(self.words)
        at = {"item_id": self.item, "output_index": 0, "content_index": 0}
        typed: list[tuple[str, JSONObject]] = [
            ("response.created", {"response": self.whole("in_progress")}),
            ("response.in_progress", {"response": self.whole("in_progress")}),
            ("response.output_item.added", {"output_index": 0, "item": item}),
            ("response.content_part.added", {**at, "part": part}),
            *(("response.output_text.delta", {**at, "delta": word}) for word in self.words),
            ("response.output_text.done", {**at, "text": text}),
            ("response.content_part.done", {**at, "part": dict(part, text=text)}),
            ("response.output_item.done", {"output_index": 0, "item": self.whole()["output"][0]}),
            ("response.completed", {"response": self.whole()}),
        ]
        events: list[Event] = [
            _sse(kind, {"type": kind, "sequence_number": number, **data})
            for number, (kind, data) in enumerate(typed)
        ]
        if handle is not None:
            last = len(typed) - 1
            events[last] = lambda: _sse(
                "response.completed",
                {
                    "type": "response.completed",
                    "sequence_number": last,
                    "response": dict(self.whole(), kv_transfer_params=handle()),
                },
            )
        return events
