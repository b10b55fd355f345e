"""Every route the proxy serves: the app, the labels and the error shapes read them here.

A route's path is written once. Metrics, access events and spans label a
request by its route, never by its raw path, so that a client cannot grow
a label set with made-up URLs.
"""

from __future__ import annotations

#: The two-leg routes: a prefill leg, then a decode leg.
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
#: OpenAI's Responses API.
RESPONSES = "/v1/responses"
#: Anthropic's Messages API, which vLLM serves.
MESSAGES = "/v1/messages"
TWO_LEG = frozenset({COMPLETIONS, CHAT_COMPLETIONS, RESPONSES, MESSAGES})

#: The single-leg routes, sent to the next decode instance as they are.
MODELS = "/v1/models"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
COUNT_TOKENS = "/v1/messages/count_tokens"
#: One stored response, and its cancel, sent to the decode instance that holds it.
RESPONSE = "/v1/responses/{id}"
RESPONSE_CANCEL = "/v1/responses/{id}/cancel"

#: The proxy's own routes; ``/health`` as vLLM answers it (what load balancers probe).
HEALTH = "/health"
HEALTHCHECK = "/healthcheck"
METRICS = "/metrics"
ADMIN_BACKENDS = "/admin/backends"
ADMIN_DRAIN = "/admin/backends/drain"
#: The status page (``docs/status-page.md``): the page, its JSON, its script and style.
STATUS_PAGE = "/"
STATUS_JSON = "/status.json"
STATUS_SCRIPT = "/status.js"
STATUS_STYLE = "/status.css"
STATUS = frozenset({STATUS_PAGE, STATUS_JSON, STATUS_SCRIPT, STATUS_STYLE})

_FIXED = frozenset(
    {
        *TWO_LEG,
        MODELS,
        TOKENIZE,
        DETOKENIZE,
        COUNT_TOKENS,
        HEALTH,
        HEALTHCHECK,
        METRICS,
        ADMIN_BACKENDS,
        ADMIN_DRAIN,
        *STATUS,
    }
)
#: What an --admin-listen endpoint serves, and the --listen endpoints then do not
#: (``/healthcheck`` they answer with readiness alone).
ADMIN_ONLY = frozenset({METRICS, ADMIN_BACKENDS, ADMIN_DRAIN, *STATUS})
ADMIN_PORT = ADMIN_ONLY | {HEALTH, HEALTHCHECK}
_RESPONSE_PREFIX = RESPONSES + "/"


def response_path(response_id: str, cancel: bool = False) -> str:
    """The path of one stored response (or of its cancel), as decode serves it."""
    return (RESPONSE_CANCEL if cancel else RESPONSE).format(id=response_id)


def route_label(path: bytes) -> str:
    """The route a path is, as a bounded label: a response's id is not one; unknown is ``other``."""
    text = path.decode("utf-8", "replace")
    if text in _FIXED:
        return text
    if text.startswith(_RESPONSE_PREFIX):
        return RESPONSE_CANCEL if text.endswith("/cancel") else RESPONSE
    return "other"


def speaks_anthropic(path: bytes) -> bool:
    """The Messages routes, whose clients parse Anthropic's shapes (errors too)."""
    return path.startswith(MESSAGES.encode())


#: The routes a client key is not asked for: health, metrics, and the admin API
#: (which has its own token).
UNKEYED = frozenset({HEALTH, HEALTHCHECK, METRICS, ADMIN_BACKENDS, ADMIN_DRAIN, *STATUS})
