"""Whose each request is, and its tenant's limits held from its admission to its end.

The tenant is the client key's (``ClientKeys``), else ``--tenant-header``'s
value. A request is counted by ``TenantLimits`` when its tenant has a limit,
and charged, when it ends, the tokens vLLM's usage says it used.
"""

from __future__ import annotations

from twisted.web.server import Request

from nixl_twisted.observe.access import record_of
from nixl_twisted.protocol import lowering, routes
from nixl_twisted.protocol.prompts import estimate_tokens
from nixl_twisted.web.keys import ClientKeys
from nixl_twisted.web.tenants import MAX_NAME, Rule, TenantLimits

#: A request with no tenant: no limit, no priority.
NO_RULE = Rule()


class Tenancy:
    """A request's tenant, found and held to its limits (``TenantLimits``)."""

    def __init__(self, keys: ClientKeys, limits: TenantLimits) -> None:
        self.keys = keys
        self.limits = limits

    def tenant(self, request: Request, path: str) -> str | None:
        """Whose the request is: its client key's tenant, else the tenant header's."""
        headers = request.requestHeaders
        if self.keys.required:
            return self.keys.tenant(headers, path.encode("utf-8"))
        if self.limits.header is None:
            return None
        named = headers.getRawHeaders(self.limits.header, [None])[0]
        return lowering.printable(named.decode("utf-8", "replace")) if named else None

    def admit(self, request: Request, path: str, body: lowering.JSONObject | None) -> Rule:
        """Hold the request to its tenant's limits (429 past one) until it ends; its rule.

        ``body`` None: a request that generates no tokens (models, tokenize, a
        stored response), held to in flight and requests per minute only.
        """
        tenant = self.tenant(request, path)
        if tenant is None:
            return NO_RULE
        record_of(request).tenant = tenant[:MAX_NAME]  # (as it is counted)
        rule = self.limits.rule(tenant)
        if not rule.counted:
            return rule  # (the common case: nothing to count, no prompt to measure)
        estimate = None if body is None else estimate_of(path, body)
        ticket = self.limits.admit(tenant, estimate)

        def ended(_: object) -> None:
            usage = record_of(request).total_usage()
            if usage is not None:
                used = (usage.prompt_tokens or 0) + (usage.completion_tokens or 0)
            elif 200 <= request.code < 300:
                used = estimate or 0  # (answered, but vLLM said nothing of its usage)
            else:
                used = 0  # (refused or failed: nothing generated is charged)
            ticket.release(used)

        request.notifyFinish().addBoth(ended)
        return rule


def estimate_of(path: str, body: lowering.JSONObject) -> int:
    """The tokens a request may use, before vLLM says: its prompts (estimated), plus
    ``max_tokens`` for each completion it asks for (each prompt of a batch, times ``n``)."""
    prompts = lowering.prompt_count(body.get("prompt")) if path == routes.COMPLETIONS else 1
    n = body.get("n")
    choices = n if type(n) is int and n > 1 else 1
    return (estimate_tokens(path, body) or 0) + prompts * choices * _max_tokens(body)


def _max_tokens(body: lowering.JSONObject) -> int:
    """The most one completion may generate, as the request says (0 if it does not)."""
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0
