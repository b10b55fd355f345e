"""The grammar of clients and tenants: keys, the tenant header, vLLM priorities, the
``[tenants.NAME]`` table, and the Redis that shares tenants' limits.

Each parser takes its own output as input, as ``values``' do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import parse_qsl, urlsplit

from cryptography import x509

from nixl_twisted.config.spelling import known_keys
from nixl_twisted.config.values import InvalidValue, as_number, text

T = TypeVar("T")

#: The query parameters a Redis URL may carry (redis-py's names, so its URLs carry over).
REDIS_PARAMETERS = ("ssl_ca_certs",)


def redis_url(value: object) -> str:
    """A Redis server's URL: ``redis://[:PASSWORD@]HOST[:PORT][/DB]``; ``rediss://`` for TLS,
    with ``?ssl_ca_certs=PATH`` to trust the CAs in that PEM file instead of the system's."""
    url = text(value)
    if any(char.isspace() or not char.isprintable() for char in url):
        raise InvalidValue(f"{url!r} must not contain whitespace or control characters")
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError as error:
        raise InvalidValue(f"{url!r} is not a valid URL: {error}") from None
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise InvalidValue(f"{url!r} must be redis://HOST[:PORT][/DB] (or rediss:// for TLS)")
    database = parts.path.strip("/")
    if database and not database.isdigit():
        raise InvalidValue(f"{url!r}: the database after the host must be a number")
    for name, given in parse_qsl(parts.query, keep_blank_values=True):
        if name not in REDIS_PARAMETERS:
            known = ", ".join(REDIS_PARAMETERS)
            raise InvalidValue(f"{url!r}: unknown parameter {name!r} (known: {known})")
        if parts.scheme != "rediss":
            raise InvalidValue(f"{url!r}: {name} is for TLS, in a rediss:// URL")
        redis_ca_file(given)
    return url


def redis_ca_file(path: str) -> str:
    """The text of a PEM file of CA certificates (``ssl_ca_certs``), read now so that a
    file that cannot be read is said at start, not at the first connection."""
    try:
        pem = Path(path).read_text(encoding="ascii")
    except (OSError, ValueError) as error:
        raise InvalidValue(f"ssl_ca_certs={path!r} cannot be read: {error}") from None
    try:
        x509.load_pem_x509_certificates(pem.encode())
    except ValueError as error:
        raise InvalidValue(f"ssl_ca_certs={path!r} holds no PEM certificate: {error}") from None
    return pem


def client_key(value: object) -> str:
    """A client API key: printable, no whitespace (it travels in a header)."""
    key = text(value)
    if not key or any(char.isspace() or not char.isprintable() for char in key):
        raise InvalidValue("must be a non-empty key without whitespace or control characters")
    return key


#: RFC 9110's tchar: what a header's name is made of.
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def header_name(value: object) -> str:
    """A request header's name: an HTTP token (RFC 9110), as ASCII letters, digits and
    ``!#$%&'*+-.^_`|~``."""
    name = text(value)
    if not name or not set(name) <= _TCHAR:
        raise InvalidValue(
            f"must be a header name (ASCII letters, digits and !#$%&'*+-.^_`|~), not {name!r}"
        )
    return name


#: The bounds of vLLM's ``priority`` (a 64-bit integer; lower is served earlier).
PRIORITY_BOUNDS = (-(2**63), 2**63 - 1)


def priority(value: object) -> int:
    """A vLLM request ``priority``: a whole number, lower served earlier (vLLM's bounds)."""
    number = as_number(value, int, "a whole number")
    if not PRIORITY_BOUNDS[0] <= number <= PRIORITY_BOUNDS[1]:
        raise InvalidValue(f"must be a 64-bit whole number, not {value!r}")
    return int(number)


#: vLLM's bound on a ``cache_salt`` (0.32: ``validate_cache_salt``), and what it may not hold.
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\0")


def cache_salt(value: object) -> str:
    """A vLLM ``cache_salt``: a non-empty string of at most 128 characters without ``@``,
    ``/``, ``\\`` or NUL (what vLLM accepts; it namespaces a request's prefix cache)."""
    if not isinstance(value, str) or not value:
        raise InvalidValue(f"must be a non-empty string, not {value!r}")
    if len(value) > MAX_CACHE_SALT or _SALT_FORBIDDEN & set(value):
        raise InvalidValue(
            f"must be at most {MAX_CACHE_SALT} characters without '@', '/', '\\' or NUL"
        )
    return value


#: A tenant's own limits, as ``[tenants.NAME]`` gives them (0: no limit).
TENANT_LIMITS = ("max-in-flight", "requests-per-minute", "tokens-per-minute")
#: What else a tenant's table may say.
TENANT_KEYS = (
    *TENANT_LIMITS,
    "priority",
    "weight",
    "cache-salt",
    "ttft-slo-ms",
    "class",
    "ttft-miss",
)

#: What a tenant's request predicted to miss its first-token target gets: refused at once
#: (429 or 503, ``admission.deadlines``), or served late.
TTFT_MISS = ("refuse", "serve")


class TenantRow(NamedTuple):
    """One ``[tenants.NAME]`` table as the configuration gives it (a tuple in the workers'
    JSON): what it leaves out is the default's (-1, or None)."""

    name: str
    #: Its limits: -1, the default's; 0, none.
    max_in_flight: int = -1
    requests_per_minute: int = -1
    tokens_per_minute: int = -1
    #: Its vLLM priority (None: the default's), its weight in the fair queue (None: 1) and
    #: its ``cache_salt`` (None: none, or the one ``--tenant-salt-secret-file`` derives).
    priority: int | None = None
    weight: float | None = None
    cache_salt: str | None = None
    #: Its requests' first-token target in ms when they name none (None: none), and the
    #: class its first-token outcomes are counted under (None: its priority's).
    ttft_slo_ms: int | None = None
    tenant_class: str | None = None
    #: What its requests predicted to miss their target get (None: "refuse").
    ttft_miss: str | None = None


@dataclass(frozen=True)
class TenantRule:
    """One tenant's rule in effect, from the configuration to its requests' ``Completion``
    and their place in the fair queue: its limits (0: none), the vLLM priority of its
    requests (None: unset), its weight in the fair queue, its ``cache_salt`` (None: none),
    the first-token target of its requests that name none (None: none) and the class its
    first-token outcomes are counted under ("": its priority's). A request with no tenant
    has ``NO_RULE``."""

    max_in_flight: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    priority: int | None = None
    weight: float = 1.0
    cache_salt: str | None = None
    ttft_slo_ms: int | None = None
    tenant_class: str = ""
    #: A request predicted to miss its first-token target: "refuse" (at once) or "serve" (late).
    ttft_miss: str = "refuse"

    @property
    def outcome_class(self) -> str:
        """The ``tenant_class`` label of its first-token outcomes: its ``class``, else
        ``priority-N``, else ``default`` (never a tenant's name: the metric stays small)."""
        if self.tenant_class:
            return self.tenant_class
        return "default" if self.priority is None else f"priority-{self.priority}"

    @property
    def counted(self) -> bool:
        """Whether there is anything to count: a limit."""
        return bool(self.max_in_flight or self.requests_per_minute or self.tokens_per_minute)

    def under(self, row: TenantRow) -> TenantRule:
        """``row``'s rule, this (the default's) where it says nothing of its own."""
        return TenantRule(
            row.max_in_flight if row.max_in_flight >= 0 else self.max_in_flight,
            row.requests_per_minute if row.requests_per_minute >= 0 else self.requests_per_minute,
            row.tokens_per_minute if row.tokens_per_minute >= 0 else self.tokens_per_minute,
            self.priority if row.priority is None else row.priority,
            1.0 if row.weight is None else row.weight,
            row.cache_salt,
            row.ttft_slo_ms,
            row.tenant_class or "",
            row.ttft_miss or "refuse",
        )


#: The rule of a request with no tenant: no limit, no priority, weight 1.
NO_RULE = TenantRule()


def weight(value: object) -> float:
    """A tenant's share of slots while tenants wait for them: a number above 0 (1: even)."""
    number = as_number(value, float, "a number")
    if not 0 < number <= 1_000_000:
        raise InvalidValue(f"must be above 0 (and at most 1000000), not {value!r}")
    return float(number)


def ttft_slo_ms(value: object) -> int:
    """A first-token target in ms: a whole number above 0, at most an hour (3600000), as a
    request's ``x-slo-ttft-ms`` (``protocol.targets``)."""
    number = as_number(value, int, "a whole number of ms")
    if not 0 < number <= 3_600_000:
        raise InvalidValue(f"must be above 0 and at most 3600000 (ms), not {value!r}")
    return int(number)


#: A tenant class, as a metric's label value: short, plain.
_CLASS = re.compile(r"[A-Za-z0-9_.-]{1,32}")


def tenant_class(value: object) -> str:
    """A tenant's class, the label its first-token outcomes are counted under: 1 to 32
    ASCII letters, digits and ``_.-``."""
    name = text(value)
    if _CLASS.fullmatch(name) is None:
        raise InvalidValue(f"must be 1 to 32 ASCII letters, digits and _.-, not {name!r}")
    return name


def ttft_miss(value: object) -> str:
    """What a tenant's request predicted to miss its first-token target gets: ``refuse``
    (429 or 503 at once, with ``Retry-After``) or ``serve`` (late)."""
    word = text(value)
    if word not in TTFT_MISS:
        raise InvalidValue(f"must be one of {', '.join(TTFT_MISS)}, not {word!r}")
    return word


def tenant_table(value: object) -> tuple[TenantRow, ...]:
    """``[tenants.NAME]`` tables (or the same as JSON text, or this parser's own output):
    each tenant's ``max-in-flight``, ``requests-per-minute`` and ``tokens-per-minute``
    (one left out is the default's, -1), its vLLM ``priority`` (None: the default's),
    its ``weight`` in the fair queue (None: 1), its ``cache-salt`` (None: none), its
    requests' first-token target ``ttft-slo-ms`` (None: none), its ``class`` (None: its
    priority's) and its ``ttft-miss`` (None: refuse), as (name, in flight, requests, tokens,
    priority, weight, salt, target, class, miss), sorted by name."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidValue("must be a table of tenants (JSON on the command line)") from None
    if isinstance(value, list | tuple):
        rows = [tuple(row) for row in value]
        if not all(len(row) == 10 and isinstance(row[0], str) for row in rows):
            raise InvalidValue(
                "must be rows of (tenant, in flight, requests, tokens, priority, weight, salt, "
                "target, class, miss)"
            )
        value = {
            row[0]: {
                key: number
                for key, number in zip(TENANT_KEYS, row[1:], strict=True)
                if number is not None
            }
            for row in rows
        }
    if not isinstance(value, dict):
        raise InvalidValue("must be a table of tenants, e.g. [tenants.team-a]")
    table = []
    for name, given in value.items():
        where = f"tenant {name!r}: "
        if not isinstance(given, dict):
            raise InvalidValue(f"{where}must be a table of {', '.join(TENANT_KEYS)}")
        limits = known_keys(given, where, TENANT_KEYS)
        numbers = []
        for key in TENANT_LIMITS:
            number = limits.get(key, -1)
            if isinstance(number, bool) or not isinstance(number, int) or number < -1:
                raise InvalidValue(f"{where}{key} must be 0 (no limit) or more, not {number!r}")
            numbers.append(number)
        own = _optional(limits, "priority", priority, where)
        share = _optional(limits, "weight", weight, where)
        salt = _optional(limits, "cache-salt", cache_salt, where)
        target = _optional(limits, "ttft-slo-ms", ttft_slo_ms, where)
        named = _optional(limits, "class", tenant_class, where)
        miss = _optional(limits, "ttft-miss", ttft_miss, where)
        in_flight, requests, tokens = numbers
        row = TenantRow(
            str(name), in_flight, requests, tokens, own, share, salt, target, named, miss
        )
        table.append(row)
    return tuple(sorted(table, key=lambda row: row.name))


def _optional(limits: dict[str, Any], key: str, read: Callable[[Any], T], where: str) -> T | None:
    """A tenant's ``key``, read by ``read`` when given (None when not); a bad one names where."""
    given = limits.get(key)
    if given is None:
        return None
    try:
        return read(given)
    except InvalidValue as error:
        raise InvalidValue(f"{where}{key} {error}") from None
