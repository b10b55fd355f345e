"""How a ``FakeVLLM`` serves a generation request, as vLLM's engine does.

Its role read from ``kv_transfer_params`` (prefill, decode or plain), the
body checked as vLLM's schema would, admitted to the queue and a slot, then
computed here (its prefix cache looked up and its KV events published) or
pulled from prefill (the ledger redeems the params, the handed token ids
taken), and answered whole or streamed in the shape of its route;
bidirectional transfer's handles are ``bidirectional``'s.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.web.server import Request

from nixl_twisted.testing import answers, prompt_ids, schema
from nixl_twisted.testing.behaviours import Behaviour, spoiled
from nixl_twisted.testing.bidirectional import Bidirectional, HandleIssuer
from nixl_twisted.testing.capacity import QUEUE_FULL, QUEUE_FULL_TYPE, Capacity
from nixl_twisted.testing.controls import Controls
from nixl_twisted.testing.engine import EngineTime
from nixl_twisted.testing.faults import Fault
from nixl_twisted.testing.kv_publisher import KvEventsMixin
from nixl_twisted.testing.ledger import TransferLedger
from nixl_twisted.testing.prefix_cache import PrefixCache, prompt_tokens
from nixl_twisted.testing.site import cut_off
from nixl_twisted.testing.transfers import PromptSources

JSONObject = dict[str, Any]


class Generation(Capacity, Controls, EngineTime, KvEventsMixin, Bidirectional):
    """Mixed into ``FakeVLLM``, whose fields these read: the engine's side of the fake."""

    name: str
    ledger: TransferLedger
    tokens: int
    model: str
    text: str
    disconnects: int
    token_ids_reused: int
    returns_token_ids: bool
    extra_headers: dict[str, str]
    recompute_silently: bool
    sources: PromptSources
    fault: Fault | None
    cache: PrefixCache
    responses: dict[str, JSONObject]
    _kv_port: int
    streams_handle: bool

    def _record(self, request: Request, body: JSONObject | None, role: str) -> None:
        raise NotImplementedError

    async def _generate(self, request: Request) -> bytes | None:
        try:
            return await self._answer(request)
        except CancelledError:
            # Klein cancels the handler when the client goes away (waiting or running).
            self.disconnects += 1
            raise

    async def _answer(self, request: Request) -> bytes | None:
        assert request.content is not None
        request.setHeader(b"Content-Type", b"application/json")
        try:
            body = json.loads(request.content.read())
        except (ValueError, RecursionError) as error:
            request.setResponseCode(400)
            return answers.vllm_error(400, f"the body is not JSON vLLM can read: {error}")
        if not isinstance(body, dict):
            request.setResponseCode(400)
            return answers.vllm_error(400, "Input should be a valid dictionary")
        kv = body.get("kv_transfer_params")
        role = "plain"
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            role = "prefill"
        elif isinstance(kv, dict) and kv.get("do_remote_prefill"):
            role = "decode"
        self._record(request, body, role)
        refused = schema.refusal(request.path.decode("utf-8"), body)
        if refused is not None:
            request.setResponseCode(400)
            return answers.vllm_error(400, refused)
        for name, value in self.extra_headers.items():
            request.setHeader(name.encode("ascii"), value.encode("utf-8"))

        if self.fault is Fault.ERROR_500:
            request.setResponseCode(500)
            return answers.vllm_error(500, "engine error (the fake's fault: 500)")
        if self.fault is Fault.HANG:
            await Deferred()  # for good: only its client leaving (a cancel) ends it
        behaviour = self._next_behaviour()
        instead = behaviour.instead()
        if instead is not None:
            status, content_type, raw = instead
            request.setResponseCode(status)
            request.setHeader(b"Content-Type", content_type)
            return raw
        if not self._admits():
            request.setResponseCode(503)
            return answers.vllm_error(503, QUEUE_FULL, QUEUE_FULL_TYPE)
        # Its compute, KV pull and tokens begin only once it runs.
        await self._take_slot()
        try:
            return await self._run(request, body, role, behaviour)
        finally:
            self._release_slot()

    async def _run(
        self, request: Request, body: JSONObject, role: str, behaviour: Behaviour
    ) -> bytes | None:
        """Serve a generation request that holds a slot: compute, pull, generate."""
        kv = body.get("kv_transfer_params")
        chat = request.path.endswith(b"/chat/completions")
        messages_api = request.path.endswith(b"/v1/messages")
        responses_api = request.path.endswith(b"/v1/responses")
        cached = pulled = 0
        wrong_kv = False
        tokens = prompt_tokens(body, self.text)
        # vLLM's chat renderer takes a prompt handed as ids on any leg (a continuation's
        # prefill, a decode-only leg); a decode leg's are taken with its KV, below.
        if role != "decode" and isinstance(kv, dict) and "prompt_token_ids" in kv:
            handed = prompt_ids.take(kv, body, chat or messages_api or responses_api)
            if handed.refusal is not None:
                request.setResponseCode(400)
                return answers.vllm_error(400, handed.refusal)
            kv = handed.params
            if handed.used is not None:
                tokens = handed.used
        if role in ("prefill", "plain"):
            # What the lookup stored and evicted is one batch, published as vLLM
            # publishes a step's events: once the step (the compute) has run.
            with self._step() as step:
                salt = body.get("cache_salt")
                cached, _ = self.cache.compute(tokens, salt if isinstance(salt, str) else None)
            try:
                if isinstance(kv, dict) and self._reads_handle(role, kv):
                    read = self._read_back(kv, tokens, cached)
                    if isinstance(read, str):
                        request.setResponseCode(500)
                        return answers.vllm_error(500, f"KV load failed: {read}")
                    pulled, wrong_kv = read
                self.sources.local_cache_hit += cached
                self.sources.external_kv_transfer += pulled
                self.sources.local_compute += len(tokens) - cached - pulled
                if pulled:
                    await self._pull_kv(pulled)
                await self._compute(len(tokens) - cached - pulled)
            finally:
                self._stepped(step)
        kv_answer: JSONObject | None = None
        if role == "prefill" and behaviour.issues_params:
            request_id = _header(request, b"x-request-id") or uuid.uuid4().hex
            kv_answer = self.ledger.issue(
                self.name, request_id, len(tokens), self._kv_port, wrong_kv=wrong_kv
            )
            kv_answer = spoiled(kv_answer, behaviour.spoiled)
        elif role == "decode" and self.recompute_silently:
            self.sources.local_compute += len(tokens)
            await self._compute(len(tokens))
        elif role == "decode":
            handed = prompt_ids.take(kv, body, chat or messages_api or responses_api)
            if handed.refusal is not None:
                request.setResponseCode(400)
                return answers.vllm_error(400, handed.refusal)
            kv = handed.params
            if handed.used is not None:
                tokens, self.token_ids_reused = handed.used, self.token_ids_reused + 1
            if self.fault is Fault.FAIL_KV:
                self.sources.failed_transfers += 1
                request.setResponseCode(500)
                return answers.vllm_error(500, "KV load failed: the fake's fault: fail-kv")
            problem = self.ledger.redeem(kv)
            if problem is not None:
                request.setResponseCode(500)
                return answers.vllm_error(500, f"KV load failed: {problem}")
            wrong_kv = self.ledger.wrong_kv(kv)
            self.sources.external_kv_transfer += len(tokens)
            cached = int(kv.get("remote_prefill_cached_tokens", 0)) if isinstance(kv, dict) else 0
            await self._pull_kv(len(tokens))
        issue = self._handle_issuer(request, role, tokens)

        limit = (
            body.get("max_output_tokens")
            if responses_api
            else body.get("max_completion_tokens") or body.get("max_tokens")
        )
        # Its answer's tokens are the same at each place: a prompt that ends with some of
        # them (a continuation's) goes on from there, to where the answer would end.
        start = answers.resumed_at(tokens)
        count = max(0, self.tokens - start)
        count = count if not isinstance(limit, int) else min(count, limit)
        # KV pulled through a stale handle: the model reads the wrong context, and says
        # the tokens of another place.
        start += 1 if wrong_kv else 0
        words = answers.words(self.text, count, start)
        handle = _issuing(issue, answers.generated_ids(start, count))
        input_tokens = len(tokens)
        if responses_api:
            reply = answers.Response(
                model=str(body.get("model", self.model)), words=words, input_tokens=input_tokens
            )
            stored = role != "prefill" and body.get("store", True)
            if not body.get("stream"):
                whole = reply.whole()
                if kv_answer is not None or handle is not None:
                    whole["kv_transfer_params"] = handle() if handle else kv_answer
                if stored:  # (as vLLM stores it: decode's handle in it)
                    self.responses[reply.id] = whole
                return answers.encode(whole)
            if stored:
                self.responses[reply.id] = reply.whole()
            await self._stream(request, reply.events(handle), *_cut(behaviour, 4, messages=False))
            return None
        if messages_api:
            message = answers.Message(
                model=str(body.get("model", self.model)),
                words=words,
                stop_reason="max_tokens" if count == limit else "end_turn",
                input_tokens=input_tokens,
            )
            if not body.get("stream"):
                whole = message.whole()
                if kv_answer is not None:
                    whole["kv_transfer_params"] = kv_answer
                return answers.encode(whole)
            await self._stream(request, message.events(), *_cut(behaviour, 2, messages=True))
            return None
        answer = answers.Answer(
            chat=chat,
            model=str(body.get("model", self.model)),
            words=words,
            finish_reason="length" if count == limit else "stop",
            usage={
                "prompt_tokens": input_tokens,
                "completion_tokens": len(words),
                "total_tokens": input_tokens + len(words),
                "prompt_tokens_details": {"cached_tokens": cached},
            },
            prompt_token_ids=(
                _said(tokens, behaviour)
                if self.returns_token_ids and prompt_ids.asked(body)
                else None
            ),
            token_ids=(
                answers.generated_ids(start, count)
                if self.returns_token_ids and prompt_ids.asked(body)
                else None
            ),
        )
        if not body.get("stream"):
            said: JSONObject | Callable[[], JSONObject] | None = handle or kv_answer
            return await self._whole(request, answer, said, behaviour.cut_after is not None)
        if self._firehose is not None:
            await self._pour(request, *self._firehose)
            return None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        cut = _cut(behaviour, 1 if chat else 0, messages=False)
        streamed = handle if self.streams_handle else None
        await self._stream(request, answer.events(include_usage, streamed), *cut)
        return None

    async def _whole(
        self,
        request: Request,
        answer: answers.Answer,
        kv: JSONObject | Callable[[], JSONObject] | None,
        broken: bool,
    ) -> bytes | None:
        if self._hold_after is not None and not self._hold_midway:
            await self._wait_at_hold()
        whole = answer.whole()
        if kv is not None:
            whole["kv_transfer_params"] = kv() if callable(kv) else kv
        raw = answers.encode(whole)
        if not broken and not (self._hold_after is not None and self._hold_midway):
            return raw
        request.setHeader(b"Content-Length", str(len(raw)).encode("ascii"))
        request.write(raw[: len(raw) // 2])
        if broken:
            await cut_off(request)
            return None
        await self._wait_at_hold()
        request.write(raw[len(raw) // 2 :])
        return None

    async def _stream(
        self,
        request: Request,
        events: Sequence[answers.Event],
        cut_after: int | None = None,
        failed: list[bytes] | None = None,
    ) -> None:
        """Write ``events`` as they come; ``cut_after``: that many, then a cut connection,
        or (``failed``) then these (vLLM's error event and the stream's end; none: the
        body ends there)."""
        request.setHeader(b"Content-Type", b"text/event-stream")
        if cut_after is not None:
            events = [*events[:cut_after], *(failed or [])]
        for index, event in enumerate(events):
            if index > 0:
                await self._before_next_token()
            if self._hold_after is not None and index >= self._hold_after:
                await self._wait_at_hold()
            request.write(event() if callable(event) else event)
        if cut_after is not None and failed is None:
            await cut_off(request)


def _cut(
    behaviour: Behaviour, opening: int, messages: bool
) -> tuple[int | None, list[bytes] | None]:
    """Where a stream of ``opening`` events before its first token is cut, and what ends it
    then (None: a cut connection; else vLLM's error event, as its route says it)."""
    if behaviour.error_after_tokens is not None:
        error = {"message": "engine failed mid-answer", "type": "InternalServerError"}
        if messages:
            said = {"type": "error", "error": {"type": "internal_error", "message": "failed"}}
            return opening + behaviour.error_after_tokens, [
                b"event: error\ndata: " + answers.encode(said) + b"\n\n"
            ]
        event = json.dumps({"error": dict(error, param=None, code=500)}).encode()
        return opening + behaviour.error_after_tokens, [
            b"data: " + event + b"\n\n",
            b"data: [DONE]\n\n",
        ]
    if behaviour.cut_after_tokens is not None:
        return opening + behaviour.cut_after_tokens, None
    if behaviour.end_after_tokens is not None:
        return opening + behaviour.end_after_tokens, []  # (then its body ends)
    return behaviour.cut_after, None


def _issuing(issue: HandleIssuer | None, output: list[int]) -> Callable[[], JSONObject] | None:
    """What makes a decode leg's handle on its prompt and ``output``, once its answer ends."""
    return None if issue is None else lambda: issue(output)


def _said(tokens: list[int], behaviour: Behaviour) -> list[int]:
    """The prompt's ids as its answer says them (a hostile instance: other ones)."""
    return [token + 1 for token in tokens] if behaviour.other_prompt_ids else tokens


def _header(request: Request, name: bytes) -> str | None:
    values = request.requestHeaders.getRawHeaders(name)
    return values[0].decode("ascii") if values else None
