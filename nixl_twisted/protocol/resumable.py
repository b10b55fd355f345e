"""Which completions a migration may continue on another decode instance, and from where.

A decode leg that fails after its first byte is continued elsewhere only
where the continuation is the answer the client would have had
(``docs/failures.md``, "Decode migrations"): the prompt and the tokens
already relayed are sent as token ids, so that nothing is tokenized again,
with what is left of ``max_tokens``. vLLM 0.32-0.34 answers the ids of a
stream's tokens on chat and text completions only (``return_token_ids``),
and carries no sampler, grammar or parser state from one request to the
next: what depends on either is refused, or continued only before its
first token (then the continuation is the whole request again).
"""

from __future__ import annotations

from dataclasses import dataclass

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.lowering import JSONObject

#: vLLM's ``max_tokens`` when a text completion names none (``CompletionRequest``).
COMPLETIONS_MAX_TOKENS = 16
#: Tokens relayed past which a stream is no longer continued: its continuation would
#: prefill that many again, and the proxy keeps the ids of at most that many per stream.
MAX_RELAYED_TOKENS = 16384

#: What a ``response_format`` may be without constraining the tokens (others are grammars).
_FREE_FORMATS = (None, "text")
#: Fields that make vLLM constrain tokens by a grammar whose state a new request restarts.
_GRAMMARS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)
#: Fields whose effect depends on the tokens a request generated itself (not its prompt).
_OWN_OUTPUT = (
    ("presence_penalty", "penalties"),
    ("frequency_penalty", "penalties"),
    ("bad_words", "bad_words"),
    ("thinking_token_budget", "thinking_budget"),
    ("logits_processors", "custom_sampling"),
    ("vllm_xargs", "custom_sampling"),
)


@dataclass(frozen=True)
class Resumable:
    """What a migration may do for one completion, read once from its body."""

    #: Why it is never moved (None: it may be).
    refused: str | None = None
    #: Why it is moved only before its first token reached the client (None: at any token).
    from_start: str | None = None

    @property
    def tracked(self) -> bool:
        """Moved at any token: its decode leg is asked for its tokens' ids."""
        return self.refused is None and self.from_start is None


#: Every field that may keep a completion from moving, or from moving at any token: most
#: bodies name none, and are read no further (one set operation).
_READ = frozenset(
    (
        "n",
        "best_of",
        "use_beam_search",
        "response_format",
        "tools",
        "seed",
        "stop",
        "echo",
        "logprobs",
        "prompt_logprobs",
        "truncate_prompt_tokens",
        *_GRAMMARS,
        *(field for field, _ in _OWN_OUTPUT),
    )
)
WHOLE = Resumable(from_start="whole")
NO_TOKEN_IDS = Resumable(from_start="no_token_ids")
ANY_TOKEN = Resumable()


def resumable(path: str, body: JSONObject, stream: bool) -> Resumable:
    """What a migration may do for a completion of ``path`` whose body is ``body``.

    A whole answer is held until it is complete, so that it always moves
    before its first token (its continuation is the request again); a stream
    moves at any token on chat and text completions, unless what it asks
    depends on state no continuation carries.
    """
    named = body.keys() & _READ
    refused = _refused(body) if named else None
    if refused is not None:
        return Resumable(refused=refused)
    if not stream:
        return WHOLE
    if path not in (routes.CHAT_COMPLETIONS, routes.COMPLETIONS):
        return NO_TOKEN_IDS
    return Resumable(from_start=_stateful(path, body)) if named else ANY_TOKEN


def _refused(body: JSONObject) -> str | None:
    """Several choices interleave in one answer, each at its own token."""
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is not None and value != 1:
            return "n"
    if body.get("use_beam_search"):
        return "beam_search"
    return None


def _stateful(path: str, body: JSONObject) -> str | None:
    """Why a stream may be continued only before its first token (None: at any)."""
    form = body.get("response_format")
    kind = form.get("type") if isinstance(form, dict) else form
    if kind not in _FREE_FORMATS or any(body.get(field) is not None for field in _GRAMMARS):
        return "structured_output"
    choice = body.get("tool_choice")
    if body.get("tools") and choice != "none":
        return "tools"
    if body.get("seed") is not None and body.get("temperature") != 0:
        return "seeded_sampling"
    if body.get("stop"):
        return "stop_strings"
    if body.get("echo"):
        return "echo"
    if path == routes.COMPLETIONS and body.get("logprobs") is not None:
        return "logprobs_offsets"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if body.get("truncate_prompt_tokens") is not None:
        return "truncation"
    for field, why in _OWN_OUTPUT:
        value = body.get(field)
        if value is not None and value != 0:
            return why
    return None


def spent(path: str, body: JSONObject, relayed: int) -> bool:
    """The ``relayed`` tokens are all ``max_tokens`` (or ``max_completion_tokens``) allows:
    only the final chunk was missing, and a continuation asked for none more would be a
    400 from vLLM; the answer ends as without migrations."""
    limits: tuple[str, ...] = ("max_tokens", "max_completion_tokens")
    if path == routes.COMPLETIONS:
        limits = ("max_tokens",)
    for field in limits:
        value = body.get(field, COMPLETIONS_MAX_TOKENS if path == routes.COMPLETIONS else None)
        if isinstance(value, int) and not isinstance(value, bool) and value - relayed <= 0:
            return True
    return False


def continued_body(path: str, body: JSONObject, prompt: list[int], relayed: int) -> JSONObject:
    """The body of a completion continued after ``relayed`` tokens; ``prompt``: the ids of
    its prompt and of those tokens (a text completion's ``prompt``; a chat's go in
    ``kv_transfer_params``, ``Completion.decode_bytes``).

    ``max_tokens`` (and ``max_completion_tokens``, ``min_tokens``) lose what
    was relayed; a chat that names none keeps none: vLLM's own limit, the
    context left, shrinks by the same tokens.
    """
    continued = dict(body)
    limits: tuple[str, ...] = ("max_tokens", "max_completion_tokens")
    if path == routes.COMPLETIONS:
        continued["prompt"] = prompt
        if "max_tokens" not in body:  # (null is no limit, absent is vLLM's 16)
            continued["max_tokens"] = COMPLETIONS_MAX_TOKENS
        limits = ("max_tokens",)
    for field in limits:
        value = continued.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            continued[field] = value - relayed
    least = body.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least:
        continued["min_tokens"] = max(0, least - relayed)
    return continued
