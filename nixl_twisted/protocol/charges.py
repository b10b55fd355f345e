"""What a request is charged against its tenant's tokens per minute before vLLM says.

Its prompt (``prompts.Measured.charged``: text estimated, each media
part at ``MEDIA_PART_TOKENS``) plus the most its completions may generate,
as vLLM bounds them: the route's own field (``max_tokens``,
``max_completion_tokens``, ``max_output_tokens``), else the route's default
(16 on ``/v1/completions``, vLLM's), else what the model's context leaves
after the prompt (``max_model_len``, from the decode instances' ``/v1/models``
cards), else ``UNKNOWN_CONTEXT_COMPLETION_TOKENS``. A request that asks for
no bound is charged as if it used the whole context: it may. When the
answer ends, vLLM's usage replaces the charge (``admission.tenancy``).
"""

from __future__ import annotations

from typing import Any

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.lowering import prompt_count

#: What one completion is charged when the request sets no bound and the model's
#: context is unknown (no health checks, or no ``max_model_len`` in its card).
UNKNOWN_CONTEXT_COMPLETION_TOKENS = 4096

#: vLLM's ``max_tokens`` on ``/v1/completions`` when the field is left out (OpenAI's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

#: Each route's fields bounding one completion, in the order vLLM reads them.
_BOUNDS: dict[str, tuple[str, ...]] = {
    routes.COMPLETIONS: ("max_tokens",),
    routes.CHAT_COMPLETIONS: ("max_completion_tokens", "max_tokens"),
    routes.RESPONSES: ("max_output_tokens",),
    routes.MESSAGES: ("max_tokens",),
}


def charge(path: str, body: dict[str, Any], prompt: int, context: int | None) -> int:
    """The tokens ``body`` may use on ``path``: its ``prompt`` tokens (``Measured.charged``),
    plus each completion's bound times the completions it asks for (each prompt of a batch,
    times ``n`` or ``best_of``).

    ``context``: the model's ``max_model_len`` (None: unknown).
    """
    prompts = prompt_count(body.get("prompt")) if path == routes.COMPLETIONS else 1
    choices = max(_count(body.get("n")), _count(body.get("best_of")))  # (vLLM's v0 best_of)
    bound = completion_bound(path, body)
    if bound is not None:
        per_prompt = bound if context is None else min(bound, context)
        return prompt + choices * prompts * per_prompt
    if context is None:
        return prompt + choices * prompts * UNKNOWN_CONTEXT_COMPLETION_TOKENS
    # (Each prompt's completion may fill what the context leaves after it.)
    return prompt + choices * max(prompts * context - prompt, 0)


def _count(value: object) -> int:
    return value if type(value) is int and value > 1 else 1


def completion_bound(path: str, body: dict[str, Any]) -> int | None:
    """The most one completion may generate, as the request (or its route's default) says;
    None: only the model's context bounds it.

    A value vLLM would refuse or read otherwise (0, a string) bounds nothing
    here: charging the context is never less than what vLLM generates.
    """
    fields = _BOUNDS.get(path, ("max_tokens",))
    for name in fields:
        value = body.get(name)
        if type(value) is int and value > 0:
            return value
    if path == routes.COMPLETIONS and "max_tokens" not in body:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return None
