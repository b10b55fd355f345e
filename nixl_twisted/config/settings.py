"""Every setting of the proxy: its name, default, check and help, in one table.

The command line (``tap.Options`` is generated from this table), the TOML
file, SIGHUP reloads, the admin API and the workers' configuration all read
values through these parsers, so a value means the same wherever it came
from. ``docs/configuration.md`` and the README's options table are checked
against this table by the tests.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from twisted.internet.endpoints import serverFromString

#: Environment variables for the secrets, so they need not appear in a
#: process listing or a file.
BACKEND_API_KEY_ENV = "NIXLPROXY_BACKEND_API_KEY"
ADMIN_TOKEN_ENV = "NIXLPROXY_ADMIN_TOKEN"
#: The OpenTelemetry SDK's own variables, read as the SDK reads them.
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACES_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


#: The routing policies by name (``nixl_twisted.backends.routing.policy`` makes each; a test
#: checks that the two agree), so that the table imports no part of the proxy.
POLICIES = ("round-robin", "least-loaded", "load", "cache-aware", "session")


class InvalidValue(ValueError):
    """A value a setting cannot take; the message says why, without the setting's name."""


def _number(value: object, kind: type[int] | type[float], what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise InvalidValue(f"must be {what}, not {value!r}")
    try:
        number = kind(value)
    except ValueError:
        raise InvalidValue(f"must be {what}, not {value!r}") from None
    if kind is int and isinstance(value, float) and value != number:
        raise InvalidValue(f"must be {what}, not {value!r}")
    return number


def ratio(value: object) -> float:
    """A number of at least 1."""
    number = _number(value, float, "a number")
    if number < 1:
        raise InvalidValue(f"must be at least 1, not {value!r}")
    return float(number)


def seconds(value: object) -> float:
    number = _number(value, float, "a number of seconds")
    if not number > 0:
        raise InvalidValue(f"must be greater than 0, not {value!r}")
    return float(number)


def seconds_or_off(value: object) -> float:
    number = _number(value, float, "a number of seconds")
    if number < 0:
        raise InvalidValue(f"must be 0 (off) or more, not {value!r}")
    return float(number)


def count(least: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        number = _number(value, int, "a whole number")
        if number < least:
            raise InvalidValue(f"must be at least {least}, not {value!r}")
        return int(number)

    return parse


def choice(*choices: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if value not in choices:
            raise InvalidValue(f"must be one of {', '.join(choices)}, not {value!r}")
        return str(value)

    return parse


def fraction(value: object) -> float:
    """A number from 0 to 1."""
    number = _number(value, float, "a number from 0 to 1")
    if not 0 <= number <= 1:
        raise InvalidValue(f"must be from 0 to 1, not {value!r}")
    return float(number)


def collector_url(value: object) -> str:
    """An OTLP collector's URL (http or https, with a host), used as given."""
    url = text(value)
    _http_url(url)
    return url


def text(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidValue(f"must be a string, not {value!r}")
    return value


class _NoReactor:
    """Endpoint parsing needs a reactor only to listen later; checking needs none."""


def endpoint(value: object) -> str:
    """A Twisted server endpoint string that Twisted can parse (nothing is bound)."""
    description = text(value)
    try:
        serverFromString(_NoReactor(), description)
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise InvalidValue(f"{description!r} is not a usable endpoint: {error}") from None
    return description


#: ``URL#dp=N``: an instance serving N data-parallel ranks; ``URL#rank=I``: one of them
#: (ASCII digits only; leading zeros dropped, and more than 9 digits is past any bound).
_RANKS = re.compile(r"(dp|rank)=0*([0-9]{1,9})")
#: The most ranks one ``#dp=N`` declares. Each rank is an instance: health-checked,
#: scraped, a label in every metric. A vLLM engine per GPU makes 1024 far more than
#: any deployment has behind one port, while a typo (``#dp=100000``) cannot make a
#: pool of a hundred thousand instances.
MAX_RANKS = 1024


def backend_url(value: object) -> str:
    """A backend base URL, without a trailing slash, maybe with its data-parallel ranks.

    A path prefix is allowed (an instance behind a path-routing ingress);
    query strings and credentials are not, since every leg appends its own
    path. The one fragment allowed says the instance's data-parallel ranks:
    ``#dp=N`` (it serves N engines behind one port) or ``#rank=I`` (one of
    them). A fragment is never sent on the wire, so it cannot be mistaken
    for part of the path.
    """
    url = text(value)
    parts = _http_url(url)
    if parts.query:
        raise InvalidValue(f"{url!r} must not have a query")
    ranks = _RANKS.fullmatch(parts.fragment) if parts.fragment else None
    if parts.fragment and ranks is None:
        raise InvalidValue(f"{url!r}: the only fragment allowed is #dp=N (N ranks) or #rank=I")
    if ranks is not None and ranks[1] == "dp" and not 1 <= int(ranks[2]) <= MAX_RANKS:
        raise InvalidValue(f"{url!r}: #dp=N must be at least 1 and at most {MAX_RANKS} ranks")
    if ranks is not None and ranks[1] == "rank" and int(ranks[2]) >= MAX_RANKS:
        raise InvalidValue(f"{url!r}: #rank=I must be below {MAX_RANKS}")
    if parts.username is not None or parts.password is not None:
        raise InvalidValue(f"{url!r} must not carry credentials; use --backend-api-key")
    base = url.split("#", 1)[0].rstrip("/")
    return f"{base}#{ranks[1]}={int(ranks[2])}" if ranks else base


def _http_url(url: str) -> SplitResult:
    """``url``'s parts, once it is an http or https URL with a host and a usable port."""
    # Checked on the raw string: urlsplit drops tabs, CR and LF, and leading
    # spaces, without a word, and the URL is stored, logged and sent as given.
    if any(char.isspace() or not char.isprintable() for char in url):
        raise InvalidValue(f"{url!r} must not contain whitespace or control characters")
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError as error:
        raise InvalidValue(f"{url!r} is not a valid URL: {error}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidValue(f"{url!r} must start with http:// or https://")
    if not parts.hostname:
        raise InvalidValue(f"{url!r} has no host")
    return parts


def rank_urls(url: str) -> list[str]:
    """The instances a declared URL stands for: ``#dp=N`` is N ranks, ``#rank=I`` each."""
    base, _, fragment = backend_url(url).partition("#")
    if fragment.startswith("dp="):
        return [f"{base}#rank={rank}" for rank in range(int(fragment[3:]))]
    return [backend_url(url)]


@dataclass(frozen=True)
class Setting:
    """One option: ``--name`` on the command line, ``name`` in the TOML file."""

    name: str
    default: Any
    parse: Callable[[object], Any]
    help: str
    #: Repeatable on the command line, a list in the file.
    many: bool = False
    #: Read from the first of these environment variables that is set, when
    #: neither the command line nor the file gives it.
    env: tuple[str, ...] = ()
    #: SIGHUP applies a new value from the file to a running proxy; False:
    #: it takes a restart (ports bound, processes spawned, clients built).
    live: bool = True


SETTINGS: tuple[Setting, ...] = (
    Setting("listen", ("tcp:8000",), endpoint, many=True, help=(
        "Endpoint to serve on, as a Twisted endpoint string (repeatable), e.g. "
        "tcp:8000:interface=127.0.0.1, ssl:8443:privateKey=key.pem:certKey=cert.pem, "
        "unix:/run/nixlproxy.sock."), live=False),
    Setting("prefill", (), backend_url, many=True, help=(
        "Base URL of a vLLM prefill instance, e.g. http://10.0.0.1:8100 "
        "(repeatable; at least one).")),
    Setting("decode", (), backend_url, many=True, help=(
        "Base URL of a vLLM decode instance, e.g. http://10.0.0.2:8200 "
        "(repeatable; at least one).")),
    Setting("backend-api-key", None, text, env=(BACKEND_API_KEY_ENV,), help=(
        "API key sent to the backends as 'Authorization: Bearer KEY' when the "
        "client sent no Authorization.")),
    Setting("connect-timeout", 10.0, seconds, help=(
        "Seconds to wait for a TCP connection to a backend."), live=False),
    Setting("backend-idle-timeout", 4.0, seconds, help=(
        "Seconds an idle backend connection is kept for reuse; keep it below "
        "vLLM's 5 s keep-alive.")),
    Setting("max-idle-per-backend", 512, count(1), help=(
        "Idle keep-alive connections kept per backend instance.")),
    Setting("prefill-timeout", 300.0, seconds, help=(
        "Seconds to wait for a prefill instance's whole answer (504 after).")),
    Setting("decode-timeout", 600.0, seconds, help=(
        "Seconds to wait for a decode instance's response headers; a "
        "non-streaming answer sends them when generation ends (504 after).")),
    Setting("stream-idle-timeout", 60.0, seconds, help=(
        "Seconds of silence allowed between two chunks of a decode body; a "
        "long generation that keeps producing tokens is never cut.")),
    Setting("prefill-retries", 2, count(0), help=(
        "Other prefill instances tried when one cannot be reached or answers 502, 503 or 504.")),
    Setting("decode-retries", 1, count(0), help=(
        "Other decode instances tried, with the same kv_transfer_params, when "
        "one cannot be reached.")),
    Setting("health-interval", 3.0, seconds_or_off, help=(
        "Seconds between GET /health checks of every instance, the first round at "
        "startup (0: off); below vLLM's 5 s keep-alive, each check reuses its connection.")),
    Setting("health-timeout", 2.0, seconds, help=(
        "Seconds a health check may take before it counts as failed.")),
    Setting("unhealthy-threshold", 3, count(1), help=(
        "Failures in a row (checks, refused connections, timeouts) that mark an "
        "instance down.")),
    Setting("healthy-threshold", 2, count(1), help=(
        "Successes in a row (checks or legs) that bring a down instance back.")),
    Setting("prefill-policy", "round-robin", choice(*POLICIES), help=(
        "How the prefill instance of each request is chosen: round-robin, "
        "least-loaded, load, cache-aware or session (docs/routing.md).")),
    Setting("decode-policy", "round-robin", choice(*POLICIES), help=(
        "How the decode instance of each request is chosen (the same names).")),
    Setting("cache-aware-balance", 1.5, ratio, help=(
        "cache-aware: an instance may hold this many times the pool's mean legs "
        "in flight (plus one) before a conversation goes to its next instance.")),
    Setting("cache-key-bytes", 512, count(1), help=(
        "cache-aware: the leading bytes of a completion's prompt that name its "
        "conversation (about one vLLM block on CPU).")),
    Setting("max-batch-prompts", 32, count(1), help=(
        "Prompts one /v1/completions request may hold; each is its own "
        "prefill/decode pair (400 past it).")),
    Setting("max-in-flight", 1024, count(1), help=(
        "Requests served at once; past it, 503 with Retry-After at once.")),
    Setting("max-connections", 4096, count(1), help=(
        "Client connections open at once, per process; past it, a new connection is "
        "answered 503 at once and closed. Keep it below the file descriptor limit.")),
    Setting("header-timeout", 10.0, seconds, help=(
        "Seconds a client has to send a request's line and headers (from the "
        "connection, or from a later request's first byte); 408 after.")),
    Setting("body-timeout", 30.0, seconds, help=(
        "Seconds a client has to send a request's body once its headers are in, "
        "extended by one second per --body-min-rate bytes received; 408 after.")),
    Setting("body-min-rate", 65536, count(0), help=(
        "Bytes per second of body that each extend --body-timeout by a second "
        "(0: the body has --body-timeout seconds, whatever its size).")),
    Setting("max-body-size", 32 * 1024 * 1024, count(1), help=(
        "Largest request body in bytes (413 past it; vLLM's default too).")),
    Setting("max-buffered-bodies", 64 * 1024 * 1024, count(1), help=(
        "Bytes of request bodies held at once, all requests together, counted as "
        "they arrive; past it, 503 with Retry-After.")),
    Setting("admin-token", None, text, env=(ADMIN_TOKEN_ENV,), help=(
        "Bearer token that enables the admin API (/admin/backends); without "
        "one there is none.")),
    Setting("metrics-listen", None, endpoint, help=(
        "Serve GET /metrics on this endpoint (e.g. tcp:9100:interface=127.0.0.1) "
        "instead of on every --listen endpoint."), live=False),
    Setting("workers", 1, count(1), help=(
        "Proxy processes sharing each TCP port (SO_REUSEPORT), supervised by "
        "this one, which checks health for all: they act as one proxy."), live=False),
    Setting("log-format", "text", choice("text", "json"), help=(
        "text (for people) or json (one flat JSON object per line on stdout, for log "
        "pipelines; the same as twistd --logger=nixl_twisted.logs.json_lines)."), live=False),
    Setting("log-level", "info", choice("debug", "info", "warn", "error", "critical"), help=(
        "Least severe events logged; warn keeps marks down, errors and failures "
        "and drops the access events.")),
    Setting("access-log", "on", choice("on", "off"), help=(
        "on: one info event per request (nixlproxy.access); off: none, "
        "the request metrics still count every request.")),
    Setting("drain-timeout", 30.0, seconds_or_off, help=(
        "On SIGTERM, seconds to let requests in flight finish before closing them.")),
    Setting("handoff-warning", 10.0, seconds, help=(
        "Seconds between prefill's answer and decode's request past which the "
        "request is counted and logged: vLLM's KV lease is 30 s.")),
    Setting("otlp-traces-endpoint", None, collector_url, env=(TRACES_ENDPOINT_ENV,), help=(
        "OTLP collector URL that turns tracing on, used as given (http/protobuf: "
        "e.g. http://collector:4318/v1/traces); OTEL_EXPORTER_OTLP_ENDPOINT turns it on "
        "too."), live=False),
    Setting("otlp-traces-protocol", "http/protobuf", choice("http/protobuf", "grpc"),
            env=(TRACES_PROTOCOL_ENV, "OTEL_EXPORTER_OTLP_PROTOCOL"), help=(
        "http/protobuf (the default) or grpc "
        "(pip install 'nixl-twisted[otlp-grpc]')."), live=False),
    Setting("otel-sampling-ratio", None, fraction, help=(
        "Share of new traces recorded, 0 to 1, parent-based: a client's sampled "
        "traceparent is always followed. Unset: the SDK's OTEL_TRACES_SAMPLER "
        "(all, by default)."), live=False),
    Setting("shutdown-delay", 0.0, seconds_or_off, help=(
        "On SIGTERM, seconds to keep accepting while /healthcheck already says not "
        "ready, so that a load balancer stops sending first.")),
)  # fmt: skip

BY_NAME: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}


def default_text(setting: Setting) -> str:
    """The default as ``--help`` and ``docs/configuration.md`` show it."""
    if setting.env:
        names = " or ".join(f"${name}" for name in setting.env)
        return names if setting.default is None else f"{names}, else {setting.default}"
    if setting.many:
        return ", ".join(setting.default) if setting.default else "(required)"
    if setting.default is None:
        return "(none)"
    if isinstance(setting.default, float) and setting.default.is_integer():
        return str(int(setting.default))
    return str(setting.default)
