"""The fake's routes besides generation: health, metrics, models, tokens, renders, stored responses.

Each answers as vLLM 0.32 does, and records the request (role ``other``)
so that tests see what reached the instance.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.server import Request

from nixl_twisted.testing import answers
from nixl_twisted.testing.prefix_cache import PrefixCache, prompt_tokens
from nixl_twisted.testing.transfers import PromptSources

JSONObject = dict[str, Any]


class OtherRoutes:
    """Mixed into ``FakeVLLM``, whose state these read."""

    model: str
    adapters: tuple[str, ...]
    max_model_len: int
    health_checks: int
    model_reads: int
    models_stalled: bool
    health_status: int
    metrics_status: int
    running: int
    waiting: int
    render_status: int
    text: str
    cache: PrefixCache
    sources: PromptSources
    generations: int
    responses: dict[str, JSONObject]

    def _record(self, request: Request, body: JSONObject | None, role: str) -> None:
        raise NotImplementedError

    def _health_checked(self) -> None:
        raise NotImplementedError

    def _json(self, request: Request) -> JSONObject:
        """The request's JSON body, recorded; the answer will be JSON too."""
        assert request.content is not None
        body: JSONObject = json.loads(request.content.read())
        self._record(request, body, "other")
        request.setHeader(b"Content-Type", b"application/json")
        return body

    def _health(self, request: Request) -> bytes:
        # Counted apart: health checks are not the API requests tests assert on.
        self.health_checks += 1
        request.setResponseCode(self.health_status)
        self._health_checked()
        return b""

    def _metrics(self, request: Request) -> bytes:
        """vLLM's own gauges and prefix-cache counters, as its ``/metrics`` names them."""
        inside = f'engine="0",model_name="{self.model}"'
        labels = f"{{{inside}}}"
        values = {
            "vllm:num_requests_running": self.running,
            "vllm:num_requests_waiting": self.waiting,
            "vllm:kv_cache_usage_perc": self.cache.usage,
            "vllm:prefix_cache_queries_total": self.cache.queries,
            "vllm:prefix_cache_hits_total": self.cache.hits,
            # (vLLM's is by finished_reason; one sum is enough to count legs by)
            "vllm:request_success_total": self.generations,
        }
        request.setResponseCode(self.metrics_status)
        request.setHeader(b"Content-Type", b"text/plain; version=0.0.4")
        gauges = "".join(f"{name}{labels} {float(v)}\n" for name, v in values.items())
        return (gauges + self.sources.exposition(inside)).encode()

    def _models(self, request: Request) -> bytes | Deferred[bytes]:
        """A client's request the proxy relayed (it has a request id) is recorded; the
        proxy's health loop reading what the instance serves is counted apart, as a check
        (``models_stalled``: never answered)."""
        if request.getHeader(b"x-request-id") is None:
            self.model_reads += 1
            if self.models_stalled:
                return Deferred()
        else:
            self._record(request, None, "other")
        request.setHeader(b"Content-Type", b"application/json")
        created = int(time.time()) + self.model_reads  # (vLLM's: the time of the answer)
        return answers.models(self.model, self.adapters, created, self.max_model_len)

    def _tokenize(self, request: Request) -> bytes:
        """vLLM's answer shape; the prompt's tokens as the prefix cache computes them."""
        tokens = prompt_tokens(self._json(request), self.text)
        return answers.encode(
            {
                "count": len(tokens),
                "max_model_len": self.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    def _render(self, request: Request) -> bytes:
        """vLLM's ``/v1/completions/render`` (a list, one per prompt) and
        ``/v1/chat/completions/render`` (one object): the token ids the engine
        would compute, the very ones its KV events carry."""
        body = self._json(request)
        if self.render_status != 200:
            request.setResponseCode(self.render_status)
            if self.render_status == 404:  # vLLM serves no such route: FastAPI's answer
                return answers.encode({"detail": "Not Found"})
            return answers.vllm_error(self.render_status, "rendering failed")
        if request.path.endswith(b"/chat/completions/render"):
            return answers.encode(_rendered("chatcmpl", prompt_tokens(body, self.text)))
        prompt = body.get("prompt")
        batch = isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt)
        bodies = [{**body, "prompt": p} for p in prompt] if batch and prompt else [body]
        return answers.encode([_rendered("cmpl", prompt_tokens(b, self.text)) for b in bodies])

    def _detokenize(self, request: Request) -> bytes:
        tokens = self._json(request).get("tokens") or []
        return answers.encode({"prompt": " ".join(f"t{t}" for t in tokens)})

    def _count_tokens(self, request: Request) -> bytes:
        body = self._json(request)
        return answers.encode({"input_tokens": answers.prompt_tokens(body, True)})

    def _stored(self, request: Request, response_id: str) -> bytes:
        """A stored response (cancelling one that is done answers it as it is), or vLLM's 404."""
        self._record(request, None, "other")
        request.setHeader(b"Content-Type", b"application/json")
        stored = self.responses.get(response_id)
        if stored is None:
            request.setResponseCode(404)
            return answers.vllm_error(404, f"Response with id '{response_id}' not found.")
        return answers.encode(stored)


def _rendered(kind: str, tokens: list[int]) -> JSONObject:
    """One prompt rendered, as vLLM 0.32 answers it (its id, its token ids: nothing else)."""
    return {"request_id": f"{kind}-{uuid.uuid4().hex[:16]}", "token_ids": tokens}
