"""Lowering: the NIXL prefill/decode bodies as pure functions (no I/O, no reactor).

Everything here follows ``docs/protocol.md`` to the letter; the lowering is part
of the proxy's identity (``nixl_twisted.identity.VERSION``).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, NoReturn

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

JSONObject = dict[str, Any]


#: Fields the prefill leg must not carry: they would make prefill stream,
#: or generate past its single token.
_PREFILL_REMOVED_FIELDS = ("stream_options", "min_tokens", "min_completion_tokens")


def new_request_id() -> str:
    """A request id unique across processes and restarts (random, 122 bits)."""
    return uuid.uuid4().hex


def prefill_kv_transfer_params(request_id: str) -> JSONObject:
    """The ``kv_transfer_params`` that ask a vLLM instance to act as prefill."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": f"xfer-{request_id}",
    }


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    """A JSON number as a float; one too large for a double (``1e400``) is refused.

    Python would read it as infinity, which no JSON encoder writes back: a
    leg's body would then fail to encode, a 500 for a client's mistake.
    """
    value = float(text)
    if math.isinf(value):
        shown = text if len(text) <= 24 else text[:24] + "..."
        raise ValueError(f"the number {shown} does not fit in a double")
    return value


# Built once: ``json.loads``/``json.dumps`` with keyword arguments build a new
# decoder or encoder on every call, which showed in the hot path's profile.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite)
_UTF8_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_ASCII_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def read_json(raw: bytes) -> Any:
    """``json.loads`` for bytes (UTF-8, -16 or -32, as RFC 8259 allows), strictly.

    ``NaN``, ``Infinity`` and numbers too large for a double (``1e400``) are a
    ``ValueError``, as malformed JSON is; a nesting past Python's recursion
    limit is a ``RecursionError``.
    """
    return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))


def _too_deep() -> Exception:
    return ProxyError(ErrorCode.JSON_TOO_DEEP, "request body is nested too deeply to be served")


def parse_client_body(raw: bytes) -> JSONObject:
    """Parse a client's body; anything but a JSON object is a 400.

    ``NaN`` and ``Infinity`` are refused: they are not JSON, and vLLM's
    parser would refuse them on a leg the client never sees; so is a number
    too large for a double (``1e400``), which would read as infinity.
    Nesting past Python's recursion limit (about 990 levels) is a 400 too.
    """
    try:
        body = read_json(raw)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ProxyError(
            ErrorCode.INVALID_JSON, f"request body is not valid JSON: {error}"
        ) from None
    if not isinstance(body, dict):
        raise ProxyError(
            ErrorCode.INVALID_BODY, "OpenAI completion request body must be a JSON object"
        )
    return body


def prompt_count(prompt: object) -> int:
    """How many prompts a ``/v1/completions`` ``prompt`` field holds.

    The OpenAI forms are a string, a list of token ids, a list of strings and
    a list of token-id lists; only the last two can hold several prompts.
    """
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(item, (str, list)) for item in prompt)
    ):
        return len(prompt)
    return 1


def check_servable(path: str, body: JSONObject) -> None:
    """Refuse, before any leg, what two legs cannot serve (``docs/protocol.md``).

    A Responses API request that continues a stored response
    (``previous_response_id``) or runs in the background: the stored
    response lives on one decode instance, and prefill would need the whole
    conversation. (A batch of prompts is served: ``batch_of`` splits it.)
    """
    if path == routes.RESPONSES:
        if body.get("previous_response_id") is not None:
            raise ProxyError(
                ErrorCode.PREVIOUS_RESPONSE_ID_UNSUPPORTED,
                "previous_response_id is not served: the stored response lives on one decode "
                "instance, and prefill would need the whole conversation; send the history "
                "in 'input' instead",
            )
        if body.get("background") is True:
            raise ProxyError(
                ErrorCode.BACKGROUND_UNSUPPORTED,
                "background responses are not served through a prefill/decode proxy",
            )


@dataclass(frozen=True)
class BatchRequest:
    """A batched completion: its prompts, and the fields the proxy merges the answers by."""

    prompts: list[Any]
    #: Choices per prompt: each part's choice ``i`` is the batch's ``prompt * n + i``.
    n: int = 1
    stream: bool = False
    #: ``stream_options.include_usage``: one summed usage chunk at the end.
    include_usage: bool = False


#: The fields that ask vLLM for several completions of one prompt.
_CHOICES = ("n", "best_of")


def check_choices(body: JSONObject, limit: int) -> None:
    """400 for a body asking more than ``limit`` completions of a prompt (``--max-n``).

    vLLM takes up to 16384 (``VLLM_MAX_N_SEQUENCES``), each a sequence
    holding decode's KV blocks; a batch multiplies them by its prompts.
    A number vLLM would refuse as such is left to vLLM.
    """
    for name in _CHOICES:
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            raise ProxyError(
                ErrorCode.TOO_MANY_CHOICES,
                f"'{name}' asks for more than {limit} completions; this proxy serves at "
                "most that many per prompt (--max-n)",
            )


def batch_of(path: str, body: JSONObject, limit: int) -> BatchRequest | None:
    """A batched completion (each prompt its own prefill/decode pair), or None.

    A batch in one request would get one ``kv_transfer_params`` for all its
    prompts, and vLLM's decode worker crashes on it ("block marked busy").
    The proxy merges the parts' answers itself, so the fields it merges by
    must mean one thing: ``n`` a whole number, ``stream`` true or false,
    ``stream_options`` an object (400 otherwise, where vLLM would coerce).
    """
    prompt = body.get("prompt")
    count = prompt_count(prompt)
    if path != routes.COMPLETIONS or count == 1:
        return None
    if count > limit:
        raise ProxyError(
            ErrorCode.TOO_MANY_PROMPTS,
            f"'prompt' holds {count} prompts; this proxy serves at most {limit} per "
            "request (--max-batch-prompts)",
        )
    assert isinstance(prompt, list)
    n = body.get("n")
    if n is not None and (type(n) is not int or n < 1):
        raise _invalid_field("n", "a whole number of at least 1", n)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid_field("stream_options", "an object", options)
    options = options or {}
    return BatchRequest(
        list(prompt),
        n=n or 1,
        stream=_flag(body, "stream"),
        include_usage=_flag(options, "include_usage", "stream_options.include_usage"),
    )


def _flag(fields: JSONObject, key: str, name: str | None = None) -> bool:
    value = fields.get(key)
    if value is not None and not isinstance(value, bool):
        raise _invalid_field(name or key, "true or false", value)
    return bool(value)


def _invalid_field(name: str, what: str, value: object) -> Exception:
    return ProxyError(
        ErrorCode.INVALID_BATCH_FIELD,
        f"'{name}' must be {what} in a batched completion, not {json_kind(value)}",
    )


def json_kind(value: object) -> str:
    """What a JSON value is, in words (an error message never echoes the value itself)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = {
        str: "a string",
        int: "a number",
        float: "a number",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }
    return kinds.get(type(value), type(value).__name__)


#: The routes whose vLLM request takes a ``priority`` (its Messages route has none).
PRIORITY_ROUTES = frozenset((routes.CHAT_COMPLETIONS, routes.COMPLETIONS, routes.RESPONSES))


def with_priority(path: str, body: JSONObject, priority: int) -> JSONObject:
    """The body with its tenant's vLLM ``priority`` (lower is served earlier).

    A client may ask a later one than its tenant's (a larger number: its own
    background work), never an earlier one; anything else it sent is replaced.
    """
    if path not in PRIORITY_ROUTES:
        return body
    asked = body.get("priority")
    if type(asked) is int and asked >= priority:
        return body
    return dict(body, priority=priority)


def usage_asked(path: str, body: JSONObject) -> JSONObject | None:
    """The body of an OpenAI stream asking vLLM for its usage, if the client did not.

    None when there is nothing to ask: not a chat or text completion stream,
    usage already asked, or ``stream_options`` not an object (vLLM refuses it).
    A client's ``continuous_usage_stats`` had no effect without ``include_usage``:
    it is turned off, so that no chunk changes but the last.
    """
    if path not in (routes.CHAT_COMPLETIONS, routes.COMPLETIONS) or body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    asked = dict(options, include_usage=True)
    if "continuous_usage_stats" in asked:
        asked["continuous_usage_stats"] = False
    return dict(body, stream_options=asked)


def prefill_body(
    body: JSONObject, request_id: str, path: str = routes.CHAT_COMPLETIONS
) -> JSONObject:
    """Lower a client's body for the prefill leg of ``path`` (one token, not streamed)."""
    if path == routes.RESPONSES:
        return _responses_prefill_body(body, request_id)
    lowered = dict(body)
    lowered["kv_transfer_params"] = prefill_kv_transfer_params(request_id)
    lowered["stream"] = False
    lowered["max_tokens"] = 1
    if "max_completion_tokens" in lowered:
        lowered["max_completion_tokens"] = 1
    for field in _PREFILL_REMOVED_FIELDS:
        lowered.pop(field, None)
    return lowered


def _responses_prefill_body(body: JSONObject, request_id: str) -> JSONObject:
    """The Responses API's own names: one output token, nothing stored, nothing in background."""
    lowered = dict(body)
    lowered["kv_transfer_params"] = prefill_kv_transfer_params(request_id)
    lowered["stream"] = False
    lowered["max_output_tokens"] = 1
    lowered["store"] = False
    lowered["background"] = False
    lowered.pop("stream_options", None)
    return lowered


def decode_body(body: JSONObject, kv_transfer_params: object) -> JSONObject:
    """The client's body plus prefill's ``kv_transfer_params``, verbatim."""
    completed = dict(body)
    completed["kv_transfer_params"] = kv_transfer_params
    return completed


def decode_only_body(body: JSONObject) -> JSONObject:
    """The client's body for a decode leg with no prefill: no ``kv_transfer_params`` at all.

    A client's own is dropped, as on every leg: vLLM computes the prompt itself.
    """
    if "kv_transfer_params" not in body:
        return body
    completed = dict(body)
    del completed["kv_transfer_params"]
    return completed


def encode(body: JSONObject) -> bytes:
    """Serialize a leg's body; non-ASCII stays UTF-8 as the client sent it.

    A lone surrogate (valid as a JSON escape, not as UTF-8) is sent escaped.
    """
    try:
        text = _UTF8_ENCODER.encode(body)
    except RecursionError:
        raise _too_deep() from None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _ASCII_ENCODER.encode(body).encode("ascii")


def printable(text: str, limit: int = 200) -> str:
    """A client's string as a log line or span may hold it: bounded, a lone surrogate escaped."""
    short = text if len(text) <= limit else text[:limit] + "..."
    return short.encode("utf-8", "backslashreplace").decode("utf-8")
