"""One completion's multi-turn reuse: the handle its prompt extends, and the one it answers.

With ``--multi-turn-reuse``, a two-leg chat or text completion whose
prompt's token ids (rendered by vLLM) extend a handle kept for its scope
sends its decode leg to the instance that holds that conversation's KV,
and its prefill leg with the handle (claimed then: never read twice), so
that prefill reads those tokens back instead of computing them
(``docs/routing.md``, "Multi-turn reuse"). Whatever came of it is said
once, in the access event (``reuse``) and the metrics. The handle its own
decode answers is kept for the turn after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.instances import Instance
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.decode_handle import HandleTaker
from nixl_twisted.reuse import NOTHING, Found, HandleStore, readable, scope_of

log = Logger()


class Reusing:
    """The handle a completion reads (at most one, at most once) and the one it keeps."""

    def __init__(
        self,
        store: HandleStore,
        completion: Completion,
        metrics: ProxyMetrics,
        record: AccessRecord,
        allowed: AllowedBackends,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.record = record
        self.allowed = allowed
        #: Its decode answer's handle and ids are worth keeping (one choice, chat or text).
        self.keeps = completion.keeps_handle
        self.scope = scope_of(completion.tenant, completion.salt, completion.served)
        self.found: Found = NOTHING
        #: The decode instance that holds the handle found (None: none to go to).
        self.pinned: Instance | None = None
        self._said = False

    async def find(self, prompt: Sequence[int] | None, legs: Legs) -> None:
        """The handle ``prompt`` extends, and the decode instance holding it (not taken)."""
        decode = legs.backends.decode
        if not self.keeps:
            return self.said("none")
        if prompt is None:
            return self.said("no_token_ids")
        found = await self.store.find(self.scope, prompt)
        handle = found.handle
        if handle is None:
            return self.said(found.why)
        readable_ = readable(handle.params)
        refused = self.allowed.host_refusal(handle.params["remote_host"]) if readable_ else None
        if refused is not None or not readable_:
            log.warn(
                "a kept handle names a remote_host the proxy does not allow ({refused}); not read",
                refused=refused or "not readable",
            )
            return self.said("disallowed_host")
        holder = [i for i in decode.instances if i.url == handle.instance and not i.draining]
        if not holder or not decode.available(holder[0]):
            return self.said("gone")  # (its decode instance is down or gone: its blocks too)
        self.found, self.pinned = found, holder[0]
        return None

    async def claimed(self, prefilled: bool) -> dict[str, Any] | None:
        """The handle's params for the prefill leg now (None: none, or taken since);
        ``prefilled``: the completion takes a prefill leg (else it is left for the next)."""
        handle = self.found.handle
        if handle is None:
            return None
        if not prefilled:
            self.said("decode_only")
            return None
        why = await self.store.claim(self.found)
        if why != "used":
            self.said(why)
            return None
        return handle.params

    def read(self, prefill: str) -> None:
        """Prefill (its URL) answered the leg that carried the handle."""
        handle = self.found.handle
        assert handle is not None
        self.said("used")
        self.store.failing.discard(prefill)
        self.record.reused_tokens = handle.covered
        self.metrics.reuse_tokens.inc(handle.covered)
        self.store.tokens_read += handle.covered

    def failed_on(self, prefill: str, error: str, request_id: str) -> None:
        """Prefill (its URL) answered the leg that carried the handle with an error: said in
        a warning once until a handle is read there again (a TTL set shorter on decode than
        ``--reuse-handle-ttl`` fails every one), each counted."""
        self.said("failed")
        if prefill in self.store.failing:
            return
        self.store.failing.add(prefill)
        log.warn(
            "prefill instance {url} failed {request_id} with decode's handle ({error}); sent "
            "again without it (said once until a handle is read there again: is "
            "--reuse-handle-ttl longer than decode's decoder_kv_blocks_ttl?)",
            url=prefill,
            request_id=request_id,
            error=error,
        )

    def said(self, outcome: str) -> None:
        """What came of it, said once (the first word is the one that counts)."""
        if self._said:
            return
        self._said = True
        self.record.reuse = outcome
        self.metrics.child(self.metrics.reuse_lookups, outcome).inc()
        self.store.lookups[outcome] += 1

    async def answered(self, taken: HandleTaker, instance: Instance) -> None:
        """Decode's answer ended whole: the handle it answered kept for the next turn."""
        scope = self.scope if self.keeps else None
        await keep(self.store, self.metrics, taken, instance, scope, "no_token_ids")


async def keep(
    store: HandleStore,
    metrics: ProxyMetrics,
    taken: HandleTaker,
    instance: Instance,
    scope: bytes | None,
    unkept: str = "off",
) -> None:
    """``taken``'s handle kept under ``scope``, counted either way (None: not kept, for the
    reason ``unkept``: ``--multi-turn-reuse`` is off, or its ids are never said)."""
    params = taken.handle
    if params is None:
        return
    if scope is None:
        outcome = unkept
    elif taken.tokens is None:
        outcome = "no_token_ids"
    elif not readable(params):
        outcome = "not_readable"
    else:
        asked = len(taken.prompt) if taken.prompt is not None else 0
        try:
            made = store.made(params, instance.url, taken.tokens, asked)
        except OverflowError:  # (an id no vocabulary has: not ids to check a prompt by)
            outcome = "no_token_ids"
        else:
            outcome = await store.keep(scope, made)
    metrics.child(metrics.reuse_handles, outcome).inc()
    store.answered[outcome] += 1


def kept_answered(
    legs: Legs, reusing: Reusing | None, answered: tuple[HandleTaker, Instance] | None
) -> None:
    """The handle a decode leg's whole answer carried kept (``reusing``'s), or counted as not,
    never waited for: the client's answer is whole already, and a replica's keep is sent to
    Redis before its client can ask again."""
    if answered is None or answered[0].handle is None:
        return
    taken, instance = answered
    if reusing is not None:
        keeping = ensureDeferred(reusing.answered(taken, instance))
    else:  # (off, or a batch's part: counted)
        unkept = "no_token_ids" if legs.config.reuse.enabled else "off"
        keeping = ensureDeferred(keep(legs.handles, legs.metrics, taken, instance, None, unkept))
    keeping.addErrback(_not_kept)


def _not_kept(failure: Failure) -> None:
    log.failure("a handle decode answered was not kept", failure)
