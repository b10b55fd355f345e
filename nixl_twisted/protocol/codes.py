"""Every error code the proxy can put in an error body, each declared once.

A code is what operators alert on (``{"error": {..., "code"}}``), so it is
a name here, never a string at the place that raises it. Each carries the
HTTP status of the answer that bears it, the OpenAI error type and a
one-line meaning; ``docs/failures.md`` (*Every error code*) shows the same
rows, and ``tests/pure/test_error_codes.py`` keeps the two equal.
"""

from __future__ import annotations

import enum
from typing import Literal

#: The OpenAI error body's ``type``: the broad class of an error.
ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "overloaded_error",
    "rate_limit_error",
    "upstream_error",
    "proxy_error",
]

_CLIENT: ErrorType = "invalid_request_error"
_OVERLOADED: ErrorType = "overloaded_error"
_UPSTREAM: ErrorType = "upstream_error"


@enum.unique
class ErrorCode(enum.Enum):
    """One error code: its value is the code as a body carries it."""

    _value_: str
    #: The status of the answer; None when the code has none of its own (below).
    status: int | None
    error_type: ErrorType
    #: One line for ``docs/failures.md``.
    meaning: str

    def __new__(
        cls, code: str, status: int | None, error_type: ErrorType, meaning: str
    ) -> ErrorCode:
        member = object.__new__(cls)
        member._value_ = code
        member.status = status
        member.error_type = error_type
        member.meaning = meaning
        return member

    @property
    def value(self) -> str:
        """The code as a body carries it (typed: mypy reads ``Enum.value`` here as Any)."""
        return self._value_

    # One row each, as the table in docs/failures.md has them.
    # -- the client's request ----------------------------------------------
    INVALID_JSON = (
        "invalid_json",
        400,
        _CLIENT,
        "the body (a completion's or an admin change's) is not JSON, or holds `NaN`, "
        "`Infinity` or a number no double holds (`1e400`)",
    )
    INVALID_BODY = (
        "invalid_body",
        400,
        _CLIENT,
        "the body is JSON but not an object (an admin change: names no `url`)",
    )
    JSON_TOO_DEEP = (
        "json_too_deep",
        400,
        _CLIENT,
        "JSON nested deeper than the proxy can read (about 990 levels)",
    )
    INVALID_BATCH_FIELD = (
        "invalid_batch_field",
        400,
        _CLIENT,
        "a batched completion's `n`, `stream` or `stream_options` the proxy cannot merge by",
    )
    INVALID_CACHE_SALT = (
        "invalid_cache_salt",
        400,
        _CLIENT,
        "a `cache_salt` vLLM would refuse: not a non-empty string of at most 128 characters "
        "without `@`, `/`, `\\` or NUL",
    )
    INVALID_TTFT_TARGET = (
        "invalid_ttft_target",
        400,
        _CLIENT,
        "a first-token target (`x-slo-ttft-ms` or an alias) that is not a whole number of "
        "ms above 0 and at most 3600000",
    )
    TOO_MANY_PROMPTS = (
        "too_many_prompts",
        400,
        _CLIENT,
        "a `/v1/completions` with more prompts than `--max-batch-prompts`",
    )
    TOO_MANY_CHOICES = (
        "too_many_choices",
        400,
        _CLIENT,
        "a completion whose `n` or `best_of` is past `--max-n`",
    )
    PREVIOUS_RESPONSE_ID_UNSUPPORTED = (
        "previous_response_id_unsupported",
        400,
        _CLIENT,
        "a `/v1/responses` with `previous_response_id`",
    )
    BACKGROUND_UNSUPPORTED = (
        "background_unsupported",
        400,
        _CLIENT,
        "a `/v1/responses` with `background: true`",
    )
    NOT_FOUND = (
        "not_found",
        404,
        _CLIENT,
        "no such route, no admin API (no `--admin-token`), no such instance (admin), "
        "no decode instance holds the response (or its id is not one: `resp_...`), or the stored "
        "response is another tenant's (or, with tenants, its owner is not known)",
    )
    MODEL_NOT_FOUND = (
        "model_not_found",
        404,
        _CLIENT,
        "a request for a `model` no decode instance serves (`/v1/models` lists those served)",
    )
    MODEL_REQUIRED = (
        "model_required",
        400,
        _CLIENT,
        "a request without `model` while the instances serve several",
    )
    METHOD_NOT_ALLOWED = (
        "method_not_allowed",
        405,
        _CLIENT,
        "a route served with other methods, which `Allow` names (methods are case-sensitive)",
    )
    MALFORMED_REQUEST = (
        "malformed_request",
        400,
        _CLIENT,
        "HTTP the proxy cannot parse or frame (RFC 9112): a `Transfer-Encoding` other than "
        "`chunked` alone, a chunk size past 16 hex digits, a control byte in a header's value",
    )
    REQUEST_HEADER_TOO_LARGE = (
        "request_header_too_large",
        431,
        _CLIENT,
        "a request line or header line too long, more than 500 headers or 16 KB of them",
    )
    INVALID_URL = (
        "invalid_url",
        400,
        _CLIENT,
        "the request's URL is not UTF-8 or its path has a `.`/`..` segment or an encoded "
        "`?`/`#`, or an admin change's `url` is not a backend URL",
    )
    INVALID_HOST = (
        "invalid_host",
        400,
        _CLIENT,
        "HTTP/1.1 without `Host`, two `Host` headers, or one not a valid host",
    )
    CONFLICTING_HEADERS = (
        "conflicting_headers",
        400,
        _CLIENT,
        "`Authorization`, `x-api-key` or the `--tenant-header` sent twice with different values",
    )
    HEADER_TIMEOUT = (
        "header_timeout",
        408,
        _CLIENT,
        "a request's line and headers not in within `--header-timeout`",
    )
    BODY_TIMEOUT = (
        "body_timeout",
        408,
        _CLIENT,
        "a body not in within `--body-timeout` plus 1 s per `--body-min-rate` bytes "
        "(`--body-max-timeout` at most), or stalled",
    )
    REQUEST_TOO_LARGE = ("request_too_large", 413, _CLIENT, "a body larger than `--max-body-size`")
    # -- the admin API -------------------------------------------------------
    INVALID_API_KEY = (
        "invalid_api_key",
        401,
        "authentication_error",
        "a client request without a key `--api-key` or `--api-keys-file` gives",
    )
    UNAUTHORIZED = (
        "unauthorized",
        401,
        "authentication_error",
        "an admin request, or `/metrics` on a `--listen` endpoint while clients need a key, "
        "without the admin bearer token",
    )
    INVALID_POOL = (
        "invalid_pool",
        400,
        _CLIENT,
        'an admin change whose `pool` is not `"prefill"` or `"decode"`',
    )
    BACKEND_NOT_ALLOWED = (
        "backend_not_allowed",
        403,
        _CLIENT,
        "an admin change adding an instance `--allowed-backends` does not allow",
    )
    LAST_INSTANCE = (
        "last_instance",
        409,
        _CLIENT,
        "an admin change that would leave a pool no instance in rotation",
    )
    # -- the proxy's own limits ------------------------------------------------
    TENANT_LIMIT = (
        "rate_limit_exceeded",
        429,
        "rate_limit_error",
        "the client's tenant is at one of its limits (in flight, requests or tokens per "
        "minute; with `--limits-redis`, the last two counted for every replica)",
    )
    TOO_MANY_REQUESTS_IN_FLIGHT = (
        "too_many_requests_in_flight",
        503,
        _OVERLOADED,
        "`--max-in-flight` requests are being served",
    )
    ENGINE_FULL = (
        "engine_full",
        503,
        _OVERLOADED,
        "every instance tried answered 503: vLLM's engine queue is full (`--max-num-queued-reqs`)",
    )
    QUEUE_FULL = (
        "queue_full",
        503,
        _OVERLOADED,
        "every instance is at its `max-in-flight` cap and `--queue-size` requests wait already",
    )
    QUEUE_TIMEOUT = (
        "queue_timeout",
        503,
        _OVERLOADED,
        "no slot came free for the request within `--queue-timeout`",
    )
    SHED = (
        "shed",
        503,
        _OVERLOADED,
        "every instance is at its cap and the tenant's priority is negative (sheddable)",
    )
    TTFT_UNREACHABLE = (
        "ttft_unreachable",
        503,
        _OVERLOADED,
        "the request's first-token target cannot be met: the queue ahead of it is predicted "
        "to take longer (or it was still waiting at its latest start)",
    )
    TTFT_UNREACHABLE_FOR_TENANT = (
        "ttft_unreachable_for_tenant",
        429,
        "rate_limit_error",
        "the request's first-token target cannot be met because its own tenant's requests "
        "waiting ahead of it, at the tenant's share of the fleet, take longer",
    )
    REQUEST_BODIES_BUFFER_FULL = (
        "request_bodies_buffer_full",
        503,
        _OVERLOADED,
        "the bodies held at once would pass `--max-buffered-bodies`",
    )
    TOO_MANY_CONNECTIONS = (
        "too_many_connections",
        503,
        _OVERLOADED,
        "`--max-connections` client connections are open",
    )
    DRAINING = (
        "draining",
        503,
        _OVERLOADED,
        "the proxy is stopping (SIGTERM) and takes no new request",
    )
    SHUTTING_DOWN = (
        "shutting_down",
        503,
        _OVERLOADED,
        "the drain timeout cut the request; mid-stream, an in-band error event",
    )
    # -- the backends ------------------------------------------------------------
    NO_HEALTHY_PREFILL = (
        "no_healthy_prefill",
        503,
        _UPSTREAM,
        "every prefill instance was tried for this request, or is draining",
    )
    NO_HEALTHY_DECODE = (
        "no_healthy_decode",
        503,
        _UPSTREAM,
        "every decode instance was tried for this request, or is draining",
    )
    PREFILL_UNREACHABLE = (
        "prefill_unreachable",
        502,
        _UPSTREAM,
        "no prefill instance could be reached, retries included",
    )
    DECODE_UNREACHABLE = (
        "decode_unreachable",
        502,
        _UPSTREAM,
        "no decode instance could be reached, retries included",
    )
    PREFILL_TIMEOUT = (
        "prefill_timeout",
        504,
        _UPSTREAM,
        "prefill's answer not in within `--prefill-timeout`",
    )
    DECODE_TIMEOUT = (
        "decode_timeout",
        504,
        _UPSTREAM,
        "decode silent past `--decode-timeout` or `--stream-idle-timeout`; "
        "mid-stream, an in-band error event",
    )
    PREFILL_FAILED = (
        "prefill_failed",
        502,
        _UPSTREAM,
        "prefill answered neither 2xx nor 4xx (502, 503 or 504 once retries ran out)",
    )
    PREFILL_INVALID_RESPONSE = (
        "prefill_invalid_response",
        502,
        _UPSTREAM,
        "prefill's answer is not JSON, or broke off",
    )
    MISSING_KV_TRANSFER_PARAMS = (
        "missing_kv_transfer_params",
        502,
        _UPSTREAM,
        "prefill's answer has no `kv_transfer_params`",
    )
    INVALID_KV_TRANSFER_PARAMS = (
        "invalid_kv_transfer_params",
        502,
        _UPSTREAM,
        "prefill's `kv_transfer_params` is not an object",
    )
    BAD_HANDOFF = (
        "bad_kv_transfer_params",
        502,
        _UPSTREAM,
        "prefill's `kv_transfer_params` lack what decode needs to pull the prompt's KV "
        "(every prefill instance tried)",
    )
    DECODE_STREAM_BROKEN = (
        "decode_stream_broken",
        502,
        _UPSTREAM,
        "decode's body broke off: an in-band error event, or a 502 for a batch answered whole",
    )
    # Codes without a status of their own.
    DECODE_BROKEN = (
        "decode_broken",
        None,
        _UPSTREAM,
        "a single-leg route's event stream broke off: in-band only",
    )
    BATCH_PART_FAILED = (
        "batch_part_failed",
        None,
        _UPSTREAM,
        "a part of a batched completion failed: with that part's status, or "
        "in-band once the batch's stream began",
    )
    # -- the proxy itself --------------------------------------------------------
    INTERNAL_ERROR = (
        "internal_error",
        500,
        "proxy_error",
        "the proxy failed unexpectedly (its log has the traceback)",
    )


def unreachable(role: str) -> ErrorCode:
    """No instance of the pool ``role`` could be reached."""
    return _of_role(role, ErrorCode.PREFILL_UNREACHABLE, ErrorCode.DECODE_UNREACHABLE)


def timed_out(role: str) -> ErrorCode:
    """An instance of the pool ``role`` did not answer in time."""
    return _of_role(role, ErrorCode.PREFILL_TIMEOUT, ErrorCode.DECODE_TIMEOUT)


def no_healthy(role: str) -> ErrorCode:
    """The pool ``role`` has no instance left to send a leg to."""
    return _of_role(role, ErrorCode.NO_HEALTHY_PREFILL, ErrorCode.NO_HEALTHY_DECODE)


def _of_role(role: str, prefill: ErrorCode, decode: ErrorCode) -> ErrorCode:
    if role == "prefill":
        return prefill
    if role == "decode":
        return decode
    raise ValueError(f"no pool is called {role!r}")
