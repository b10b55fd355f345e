"""Batched ``/v1/completions``: one prefill/decode pair per prompt, merged as vLLM would answer.

A batch in one request would get one ``kv_transfer_params`` for all its
prompts from prefill, which crashes vLLM's decode worker ("block marked
busy"). So each prompt is its own part: its own request id and exchange,
at most ``CONCURRENCY`` at once, each writing to a ``PartRequest`` instead
of the client. The batch merges what they answer:

- whole: ``choices[].index`` is ``prompt_index * n + choice_index``, ``usage``
  the parts' sums, ``id``/``created``/``model`` the first part's;
- streamed: each part's events as they come, their ``index`` rewritten the
  same way, the usage chunk (``stream_options.include_usage``) summed at the
  end, one ``data: [DONE]`` after the last part.

A part that fails before anything was sent fails the request with its error
(the others are cancelled, which frees their KV blocks); after the stream
started, an in-band error event, and a connection never passed off as
complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import (
    Deferred,
    DeferredSemaphore,
    FirstError,
    ensureDeferred,
    gatherResults,
    succeed,
)
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from nixl_twisted.exchange.relay import break_off
from nixl_twisted.observe.access import AccessRecord, record_of
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.lowering import JSONObject

#: Parts run at once, per batch.
CONCURRENCY = 8


class PartRequest:
    """What an exchange writes to, for one prompt of a batch: collected, not sent.

    An ``ExchangeRequest``, as the client's own request is: the type checker
    holds it to what the exchange reads and writes.
    """

    def getHeader(self, name: bytes) -> bytes | None:
        return self._client.getHeader(name)

    def __init__(self, client: Request, index: int, on_data: Callable[[bytes], None]) -> None:
        self._client = client
        #: Which prompt of the batch it answers (its request id ends with it).
        self.index = index
        self.uri = client.uri
        self.path = client.path
        self.requestHeaders = client.requestHeaders
        #: Set when the batch itself cancels this part (another part failed): why,
        #: for its exchange to say instead of "client left".
        self.ended_by: str | None = None
        self.responseHeaders = Headers()
        self.code = 200
        self.channel = None  # no connection of its own: nothing to close or pause
        self.startedWriting = False
        self._on_data = on_data
        #: This part's own access record, listed in the batch's event.
        self.access = AccessRecord()

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        self.code = code

    def write(self, data: bytes) -> None:
        self.startedWriting = True
        self._on_data(data)


class _Part:
    def __init__(self, batch: Batch, index: int) -> None:
        self.batch = batch
        self.index = index
        self.body = bytearray()
        self.buffer = b""
        self.done = False  # streamed: its [DONE] arrived
        self.usage: JSONObject | None = None
        self.request = PartRequest(batch.client, index, self.received)

    def received(self, data: bytes) -> None:
        if not self.batch.stream or self.request.code != 200:
            self.body += data
            return
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            self.batch.event(self, event)


class Batch:
    """Serves one batched completion: each prompt its own part, served by ``exchange``."""

    def __init__(
        self,
        client: Request,
        completion: Completion,
        exchange: Callable[[PartRequest, Completion], Deferred[None]],
    ) -> None:
        batch = completion.batch
        assert batch is not None
        self.client = client
        #: Each prompt's own completion (``Completion.parts``).
        self.completions = completion.parts()
        self.exchange = exchange
        self.n = batch.n
        self.stream = batch.stream
        self.include_usage = batch.include_usage
        self.parts = [_Part(self, i) for i in range(len(self.completions))]
        # The client's access event lists each part's legs.
        record_of(client).parts = [record_of(part.request) for part in self.parts]
        self._running: list[Deferred[None]] = []
        self._first: JSONObject | None = None
        self._failed = False

    def start(self) -> Deferred[None]:
        """Run every part; the Deferred is the one Klein cancels on disconnect."""
        limit = DeferredSemaphore(CONCURRENCY)
        runs = [limit.run(self._run, part) for part in self.parts]
        self._running = runs
        merged = gatherResults(runs, consumeErrors=True)
        outcome: Deferred[None] = Deferred(lambda _: self._cancel())
        merged.addCallbacks(lambda _: ensureDeferred(self._finish()), self._part_failed)
        merged.addBoth(self._settle, outcome)
        return outcome

    def _settle(self, result: object, outcome: Deferred[None]) -> None:
        if outcome.called:
            return  # cancelled: the client left
        if isinstance(result, Failure):
            outcome.errback(result)
        else:
            outcome.callback(None)

    def _run(self, part: _Part) -> Deferred[None]:
        if self._failed:
            return succeed(None)  # the batch failed: the parts not started never are
        return self.exchange(part.request, self.completions[part.index])

    def _cancel(self, why: str | None = None) -> None:
        """Cancel the parts still running; ``why``: the batch's reason, if not its client."""
        self._failed = True
        for part in self.parts:
            part.request.ended_by = part.request.ended_by or why
        for run in self._running:
            run.cancel()

    def _part_failed(self, failure: Any) -> Any:
        self._cancel("cancelled: another part of the batch failed")
        error = failure.value.subFailure if failure.check(FirstError) else failure
        if not self.client.startedWriting:
            return error
        return ensureDeferred(self._break("a part of the batch failed: " + _reason(error)))

    async def _break(self, message: str) -> None:
        await break_off(self.client, message, ErrorCode.BATCH_PART_FAILED)

    # -- streamed --------------------------------------------------------------

    def event(self, part: _Part, raw: bytes) -> None:
        payload = raw.strip().removeprefix(b"data: ")
        if payload == b"[DONE]":
            part.done = True
            return
        chunk = json.loads(payload)
        choices = chunk.get("choices") or []
        if not choices and chunk.get("usage") is not None:
            part.usage = chunk["usage"]  # summed at the end
            return
        for choice in choices:
            choice["index"] = part.index * self.n + int(choice.get("index", 0))
        if self._first is None:
            self._first = chunk
            self.client.setResponseCode(200)
            self.client.setHeader(b"Content-Type", b"text/event-stream")
        self.client.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    # -- the end ---------------------------------------------------------------

    async def _finish(self) -> None:
        failing = next((p for p in self.parts if p.request.code != 200), None)
        if failing is not None and not self.client.startedWriting:
            self._cancel("cancelled: another part of the batch failed")
            raise _as_error(failing)
        if self.stream:
            if failing is not None or not all(p.done for p in self.parts):
                await self._break("a part of the batch broke off")
                return
            if self.include_usage and self._first is not None:
                usage = _sum([p.usage or {} for p in self.parts])
                chunk = {k: self._first[k] for k in ("id", "object", "created", "model")}
                self.client.write(
                    b"data: " + json.dumps(dict(chunk, choices=[], usage=usage)).encode() + b"\n\n"
                )
            self.client.write(b"data: [DONE]\n\n")
            return
        answers = []
        for part in self.parts:
            try:
                answers.append(json.loads(bytes(part.body)))
            except ValueError:
                raise ProxyError(
                    ErrorCode.DECODE_STREAM_BROKEN, "a part of the batch broke off"
                ) from None
        merged = dict(answers[0])
        merged["choices"] = [
            dict(choice, index=i * self.n + int(choice.get("index", 0)))
            for i, answer in enumerate(answers)
            for choice in answer.get("choices", [])
        ]
        merged["usage"] = _sum([a.get("usage") or {} for a in answers])
        raw = json.dumps(merged).encode()
        self.client.setResponseCode(200)
        self.client.setHeader(b"Content-Type", b"application/json")
        self.client.setHeader(b"Content-Length", str(len(raw)).encode())
        self.client.write(raw)


def _sum(usages: list[JSONObject]) -> JSONObject:
    total: JSONObject = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total


def _as_error(part: _Part) -> ProxyError:
    """A part's own error answer, as the batch's (vLLM's body when it is an OpenAI error)."""
    try:
        error = json.loads(bytes(part.body))["error"]
        message = str(error.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        message = f"a part of the batch was answered HTTP {part.request.code}"
    return ProxyError(ErrorCode.BATCH_PART_FAILED, message, status=part.request.code)


def _reason(failure: Any) -> str:
    value = failure.value
    return value.message if isinstance(value, ProxyError) else str(value)
