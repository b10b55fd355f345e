"""A client's request, read once at the door: one immutable value that knows it.

``read_completion`` turns a two-leg route's bytes into a ``Completion``: the
body parsed once, every refusal of a bad body (400) made there, and each
fact a later room needs (the prompt measured, rendered, its token ids)
worked out at most once, when first asked. What is sent is derived from it:
the leg bodies are its methods, each encoded once per leg, and a variant (a
tenant's priority, usage asked for the proxy's sake, the model its
instances must serve, a batch's parts) is a new value that keeps the facts
already worked out. ``read_relayed`` does the same for a one-leg route.

The body is the client's, parsed: nothing below the door reads or changes
it but through this value (``tests/pure/test_rooms.py`` holds them to it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from nixl_twisted.config import NO_RULE, TenantRule
from nixl_twisted.protocol import charges, lowering, routes, salts, token_ids
from nixl_twisted.protocol.lowering import BatchRequest, JSONObject
from nixl_twisted.protocol.prompts import Measured, Rendered, measure, render
from nixl_twisted.protocol.resumable import Resumable, continued_body, resumable
from nixl_twisted.protocol.targets import FROM_TENANT, Target

#: The facts a variant keeps (they read the prompt, which no variant changes).
_KEPT = ("measured", "rendered")


@dataclass(frozen=True, eq=False)
class Completion:
    """One completion on a two-leg route, as the door read it."""

    path: str
    body: JSONObject
    request_id: str
    #: A batched ``/v1/completions`` (each prompt its own exchange), or None.
    batch: BatchRequest | None = None
    #: The model its instances must serve (``backends.models.resolve``; None: any).
    served: str | None = None
    #: Its stream's usage is asked of vLLM for the proxy's sake (a tenant's tokens),
    #: not the client's, whose stream goes without it.
    hides_usage: bool = False
    #: Whose it is (None: no tenant), and its tenant's rule (``admitted``): its place in
    #: the proxy's fair queue while instances are at their caps, among the rest.
    tenant: str | None = None
    rule: TenantRule = NO_RULE
    #: The ``cache_salt`` both legs carry (None: none): the namespace of its prefix cache,
    #: and so of every routing key (``backends.prompt_keys``).
    salt: str | None = None
    #: A chat continued on another decode instance (``continued``): the ids of its prompt
    #: and of the tokens relayed, which both legs carry instead of its messages rendered.
    resumed: tuple[int, ...] | None = None
    #: Its first token's target from its arrival, and where it came from (None: none):
    #: a header's (``protocol.targets``), else its tenant's ``ttft-slo-ms``.
    ttft_target: Target | None = None

    @property
    def model(self) -> object:
        """The ``model`` the client named, as it sent it (not always a string)."""
        return self.body.get("model")

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @cached_property
    def measured(self) -> Measured:
        """The prompt measured: its estimate, and what a tenant is charged for it."""
        return measure(self.path, self.body)

    @property
    def estimate(self) -> int | None:
        """The prompt's tokens, estimated (None: its length is not in its bytes)."""
        return self.measured.estimate

    @cached_property
    def rendered(self) -> Rendered:
        """The prompt as text, for the routing policies' keys and memory."""
        return render(self.body)

    @property
    def token_ids(self) -> tuple[int, ...] | None:
        """A prompt given as token ids, as given (None: text, to be rendered by vLLM)."""
        return self.rendered.ids

    @cached_property
    def resumable(self) -> Resumable:
        """What a migration may do for it, should its decode instance fail mid-answer."""
        return resumable(self.path, self.body, self.stream)

    @property
    def user(self) -> str | None:
        """The body's ``user``: a session's key when no ``X-Session-ID`` names one."""
        user = self.body.get("user")
        return user if isinstance(user, str) and user else None

    def charge(self, context: int | None) -> int:
        """The most tokens it may use, charged to its tenant until vLLM says (``charges``);
        ``context``: its model's ``max_model_len`` (None: unknown)."""
        return charges.charge(self.path, self.body, self.measured.charged, context)

    # -- variants ---------------------------------------------------------------

    def admitted(self, tenant: str, rule: TenantRule) -> Completion:
        """As its tenant's ``rule`` sends it: with the tenant's vLLM ``priority`` and
        ``cache_salt`` (both legs are lowered from it; ``salts.combined`` with the client's
        own), a stream asking for its usage when the tenant's tokens count, its tenant's
        place in the fair queue, and its tenant's first-token target when it named none."""
        body = self.body
        if rule.priority is not None:
            body = lowering.with_priority(self.path, body, rule.priority)
        own = self.salt
        if rule.cache_salt is not None:
            own = salts.combined(rule.cache_salt, self.salt)
            body = dict(body, cache_salt=own)
        asked = lowering.usage_asked(self.path, body) if rule.tokens_per_minute else None
        queued: dict[str, Any] = {"tenant": tenant, "rule": rule, "salt": own}
        if self.ttft_target is None and rule.ttft_slo_ms is not None:
            queued["ttft_target"] = Target(rule.ttft_slo_ms, FROM_TENANT)
        if asked is not None:
            return self._variant(body=asked, hides_usage=True, **queued)
        return self._variant(body=body, **queued)

    def parts(self) -> tuple[Completion, ...]:
        """A batch's prompts, each its own completion: ``R-0``, ``R-1``, ... (its usage is
        the batch's to sum, so no part hides it)."""
        assert self.batch is not None
        return tuple(
            replace(
                self,
                body=dict(self.body, prompt=prompt),
                request_id=f"{self.request_id}-{i}",
                batch=None,
                hides_usage=False,
            )
            for i, prompt in enumerate(self.batch.prompts)
        )

    def continued(self, prompt: list[int], relayed: int) -> Completion:
        """This completion after ``relayed`` tokens reached its client, to be continued on
        another decode instance: ``prompt`` the ids of its prompt and of those tokens
        (``protocol.resumable``; its facts are worked out again, for a longer prompt)."""
        body = continued_body(self.path, self.body, prompt, relayed)
        ids = tuple(prompt) if self.path != routes.COMPLETIONS else None
        return replace(self, body=body, resumed=ids)

    def _variant(self, **changes: Any) -> Completion:
        made = replace(self, **changes)
        for name in _KEPT:
            if name in self.__dict__:  # (worked out already: the prompt is the same)
                made.__dict__[name] = self.__dict__[name]
        return made

    # -- what is sent -----------------------------------------------------------

    @property
    def hands_token_ids(self) -> bool:
        """Decode would use the prompt's token ids, prefill asked for them (``token_ids``;
        a continuation has its own)."""
        return self.resumed is None and token_ids.used_by_decode(self.path, self.body)

    @property
    def keeps_handle(self) -> bool:
        """Decode's handle on its answer's KV is worth keeping for the next turn: a chat or
        text completion of one prompt and one choice, whose ids decode can say
        (``return_token_ids``; a continuation's are its own), and whose ids are all it is:
        text only (an image's placeholder ids are the same for another image of its size,
        so ids cannot tell a changed image)."""
        body = self.body
        chat = self.path == routes.CHAT_COMPLETIONS
        return (
            (token_ids.text_only(body.get("messages")) if chat else self.path == routes.COMPLETIONS)
            and "prompt_embeds" not in body
            and self.batch is None
            and self.resumed is None
            and body.get("n") in (None, 1)
            and body.get("best_of") in (None, 1)
            and not body.get("use_beam_search")
            and not body.get("echo")
        )

    def prefill_bytes(self, ask_token_ids: bool = False, handle: JSONObject | None = None) -> bytes:
        """The prefill leg's body: lowered (one token, not streamed), encoded;
        ``ask_token_ids``: asking for the prompt's token ids too; ``handle``: decode's, its
        ``kv_transfer_params`` verbatim (prefill reads what it holds back from decode)."""
        lowered = lowering.prefill_body(self.body, self.request_id, self.path)
        if handle is not None:
            lowered["kv_transfer_params"] = handle
        if self.resumed is not None:
            lowered = token_ids.given(lowered, self.resumed)
        return lowering.encode(token_ids.asking(lowered) if ask_token_ids else lowered)

    def decode_bytes(self, params: JSONObject, tracked: bool = False) -> bytes:
        """The decode leg's body: the client's, plus prefill's ``kv_transfer_params`` verbatim;
        ``tracked``: asking for the ids of the tokens it streams (a migration's)."""
        return self._decoded(lowering.decode_body(self.body, params), tracked)

    def decode_only_bytes(self, tracked: bool = False) -> bytes:
        """The decode leg's body when prefill is skipped: no ``kv_transfer_params`` at all
        (but a continuation's prompt ids)."""
        return self._decoded(lowering.decode_only_body(self.body), tracked)

    def _decoded(self, leg: JSONObject, tracked: bool) -> bytes:
        if self.resumed is not None:
            leg = token_ids.given(leg, self.resumed)
        return lowering.encode(token_ids.asking(leg) if tracked else leg)


def read_completion(
    raw: bytes,
    path: str,
    request_id: str,
    max_batch_prompts: int,
    served: Callable[[object], str | None] = lambda model: None,
    max_n: int = 128,
    target: Target | None = None,
) -> Completion:
    """A two-leg route's body read: a ``ProxyError`` (400) for one the proxy cannot serve
    (``max_n``: the choices a prompt may ask for, ``--max-n``).

    ``served``: the model its instances must serve, given the one the body
    names (raising the route's refusal when none serves it); ``target``: its first-token
    target, as its headers name it (``protocol.targets``).
    """
    body = lowering.parse_client_body(raw)
    lowering.check_servable(path, body)
    lowering.check_choices(body, max_n)
    model = served(body.get("model"))
    batch = lowering.batch_of(path, body, max_batch_prompts)
    salt = salts.client_salt(body)
    return Completion(path, body, request_id, batch, model, salt=salt, ttft_target=target)


@dataclass(frozen=True)
class Relayed:
    """A one-leg route's request (``/v1/models``, ``/tokenize``, a stored response), as read."""

    path: str
    request_id: str
    #: The JSON body to send, encoded once, the client's ``kv_transfer_params`` left out
    #: (None: a GET).
    body: bytes | None = None
    #: The ``model`` the body names (None: none, or no body).
    model: object = None
    #: The model its instance must serve (``backends.models.resolve``; None: any).
    served: str | None = None

    def routed(self, model: str | None) -> Relayed:
        """For an instance that serves ``model`` (None: any)."""
        return self if model == self.served else replace(self, served=model)


def read_relayed(raw: bytes | None, path: str, request_id: str) -> Relayed:
    """A one-leg route's body (None: none to send) read: a ``ProxyError`` (400) if it is not
    a JSON object. Its ``kv_transfer_params`` are the proxy's to set, never the client's."""
    if raw is None:
        return Relayed(path, request_id)
    body = lowering.parse_client_body(raw)
    model = body.get("model")
    if "kv_transfer_params" in body:
        body = {key: value for key, value in body.items() if key != "kv_transfer_params"}
    return Relayed(path, request_id, lowering.encode(body), model)
