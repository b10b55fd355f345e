"""A prompt's token ids as vLLM will see them, from vLLM's own render endpoints, for kv-aware.

``kv-aware`` matches a prompt's blocks against what each instance holds,
so it needs the prompt's token ids with the chat template applied, exactly
as the engine will tokenize it. vLLM answers that itself:
``/v1/completions/render`` and ``/v1/chat/completions/render`` take the
request's own body and return its ``token_ids`` (they need ``vllm serve
--enable-scale-out``; without it they answer 403). One small request per
completion, to an instance of the pool in rotation, under
``--render-timeout``; the answers are cached by body (LRU), so a retried or
repeated request costs nothing. A prompt of token ids needs no render.
When a render fails, the request is routed without token ids
(``fallback_render``): it never fails because of this.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from twisted.internet.defer import CancelledError, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.routing import Routing
from nixl_twisted.backends.service import BackendService
from nixl_twisted.backends.upstream import Upstream, read_body
from nixl_twisted.config import Disaggregation
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.headers import for_rank

log = Logger()

#: The routes vLLM renders, and where.
RENDER_PATHS = {
    routes.COMPLETIONS: "/v1/completions/render",
    routes.CHAT_COMPLETIONS: "/v1/chat/completions/render",
}
#: Renders remembered (one prompt's token ids each).
CACHED = 1024


def token_ids(answer: Any) -> tuple[int, ...] | None:
    """The token ids of a render answer: an object, or a list of one per prompt (the first)."""
    if isinstance(answer, list) and answer:
        answer = answer[0]
    ids = answer.get("token_ids") if isinstance(answer, dict) else None
    if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return tuple(ids)
    return None


def wanted(
    backends: BackendService,
    rules: Disaggregation,
    model: str | None,
    listening: bool,
    reused: bool = False,
) -> BackendPool | None:
    """The pool to render a prompt with, when anything in use needs its token ids.

    A pool's whose policy for ``model`` reads them, or, for the
    cached-on-decode rule while some instance's events are read (``listening``),
    the decode pool's, or for multi-turn reuse (``reused``) the prefill pool's;
    None: nothing looks.
    """
    for pool in backends.pools():
        if pool.policy_for(model).needs.token_ids:
            return pool
    if rules.uncached and listening:
        return backends.decode
    return backends.prefill if reused else None


class Renderer:
    """Token ids for prompts, from the render endpoint of an instance of ``pool``."""

    def __init__(self, upstream: Upstream, clock: IReactorTime) -> None:
        self.upstream = upstream
        self.clock = clock
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._cursor = 0
        #: The last failure, logged once until a render works again.
        self._failing: str | None = None

    async def routed(
        self,
        pool: BackendPool,
        routing: Routing,
        completion: Completion,
        headers: Headers,
        timeout: float,
    ) -> Routing:
        """``routing`` with the prompt's token ids, or why there are none."""
        if routing.tokens is not None:
            return routing
        ids, why = await self.tokens(pool, completion, headers, timeout)
        # (Fresh ``matched`` and ``predicted``: the given may be shared ones, ``NO_ROUTING``'s.)
        return replace(routing, tokens=ids, untokenized=why, matched={}, predicted={})

    async def tokens(
        self,
        pool: BackendPool,
        completion: Completion,
        headers: Headers,
        timeout: float,
    ) -> tuple[tuple[int, ...] | None, str | None]:
        """The prompt's token ids, or None and why not (``render`` failed, ``no_render``).

        Rendered by an instance that serves its model (its tokenizer is the one that counts).
        """
        path, model = completion.path, completion.served
        target = RENDER_PATHS.get(path)
        if target is None:
            return None, "no_render"  # (Responses, Messages: vLLM renders neither for us)
        raw = json.dumps(completion.body, sort_keys=True, separators=(",", ":")).encode()
        key = hashlib.blake2b(path.encode() + b"\0" + raw, digest_size=16).digest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached, None
        instances = [
            i for i in pool.instances if pool.available(i) and (model is None or i.serves(model))
        ]
        if not instances:
            return None, "render"
        instance = instances[self._cursor % len(instances)]
        self._cursor += 1

        async def render() -> tuple[int, ...]:
            url = instance.base + target
            response = await self.upstream.post(url, raw, for_rank(headers, instance.rank))
            answer = await read_body(response)
            if response.code != 200:
                raise ValueError(f"{target} answered HTTP {response.code}")
            ids = token_ids(json.loads(answer))
            if ids is None:
                raise ValueError(f"{target} answered no token_ids")
            return ids

        try:
            ids = await ensureDeferred(render()).addTimeout(timeout, self.clock)
        except CancelledError:
            raise  # the client left: nothing failed
        except Exception as error:
            self._failed(instance.url, f"{type(error).__name__}: {error}")
            return None, "render"
        if self._failing is not None:
            log.info("rendering prompts works again ({url})", url=instance.url)
            self._failing = None
        self._cache[key] = ids
        while len(self._cache) > CACHED:
            self._cache.popitem(last=False)
        return ids, None

    def _failed(self, url: str, reason: str) -> None:
        if self._failing is None:
            gated = "403" in reason or "404" in reason
            log.warn(
                "cannot render prompts ({url}: {reason}){hint}; until it can, kv-aware routes "
                "such requests as cache-aware and multi-turn reuse reads nothing back",
                url=url,
                reason=reason,
                hint=": vllm serve needs --enable-scale-out" if gated else "",
            )
        self._failing = reason
