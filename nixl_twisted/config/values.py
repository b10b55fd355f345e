"""The grammar of setting values: each parser checks one kind and says why a value is refused.

A parser takes its own output as input, so a value read back (from a
worker's JSON, or a reload) parses to itself.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, urlsplit

from twisted.internet.endpoints import serverFromString

#: The routing policies by name, as ``nixl_twisted.backends.policies.REGISTRY`` knows
#: them (a test holds the two equal), so that the table imports nothing of the proxy.
POLICIES = ("round-robin", "least-loaded", "load", "cache-aware", "session", "kv-aware")


class InvalidValue(ValueError):
    """A value a setting cannot take; the message says why, without the setting's name."""


def as_number(value: object, kind: type[int] | type[float], what: str) -> Any:
    """``value`` as an int or a float (``kind``), or ``InvalidValue`` saying it must be ``what``."""
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
    number = as_number(value, float, "a number")
    if number < 1:
        raise InvalidValue(f"must be at least 1, not {value!r}")
    return float(number)


def seconds(value: object) -> float:
    number = as_number(value, float, "a number of seconds")
    if not number > 0:
        raise InvalidValue(f"must be greater than 0, not {value!r}")
    return float(number)


def seconds_or_off(value: object) -> float:
    number = as_number(value, float, "a number of seconds")
    if number < 0:
        raise InvalidValue(f"must be 0 (off) or more, not {value!r}")
    return float(number)


def count(least: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        number = as_number(value, int, "a whole number")
        if number < least:
            raise InvalidValue(f"must be at least {least}, not {value!r}")
        return int(number)

    return parse


#: The most ``--decode-migrations`` may be: each move prefills the prompt and every token
#: relayed again, and a decode that breaks every answer would be tried so many times a request.
MAX_MIGRATIONS = 8


def migrations(value: object) -> int:
    """Moves per completion: 0 (off) to ``MAX_MIGRATIONS``."""
    number = count(0)(value)
    if number > MAX_MIGRATIONS:
        raise InvalidValue(
            f"must be at most {MAX_MIGRATIONS}, not {value!r}: each move prefills the prompt "
            "and the tokens relayed again, so a decode that breaks every answer would cost "
            "that many prefills a request"
        )
    return number


def port_or_off(value: object) -> int:
    """A TCP port, or 0 for none."""
    number = as_number(value, int, "a port number")
    if not 0 <= number <= 65535:
        raise InvalidValue(f"must be a port from 1 to 65535, or 0 (none), not {value!r}")
    return int(number)


def choice(*choices: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if value not in choices:
            raise InvalidValue(f"must be one of {', '.join(choices)}, not {value!r}")
        return str(value)

    return parse


def switch(value: object) -> bool:
    """``on`` or ``off`` (a TOML boolean too)."""
    if isinstance(value, bool):
        return value
    if value not in ("on", "off"):
        raise InvalidValue(f"must be on or off, not {value!r}")
    return value == "on"


def fraction(value: object) -> float:
    """A number from 0 to 1."""
    number = as_number(value, float, "a number from 0 to 1")
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
#: ``kv-events=PORT`` or ``kv-events=tcp://HOST:PORT`` (and ``kv-replay=``): where the
#: instance publishes its KV cache events, and answers replays.
_KV = re.compile(r"(kv-events|kv-replay)=(0*[0-9]{1,5}|tcp://[^&#\s]+:[0-9]{1,5})")
#: ``max-in-flight=N``: the legs the instance (each of its ranks) takes at once.
_CAP = re.compile(r"max-in-flight=0*([0-9]{1,6})")
#: The most ranks one ``#dp=N`` declares. Each rank is an instance: health-checked,
#: scraped, a label in every metric. A vLLM engine per GPU makes 1024 far more than
#: any deployment has behind one port, while a typo (``#dp=100000``) cannot make a
#: pool of a hundred thousand instances.
MAX_RANKS = 1024
_FRAGMENTS = (
    "the fragment is #dp=N (N ranks) or #rank=I, kv-events=PORT and kv-replay=PORT "
    "(or tcp://HOST:PORT) and max-in-flight=N, joined by &"
)


def backend_url(value: object) -> str:
    """A backend base URL, without a trailing slash, maybe with its ranks and KV event ports.

    A path prefix is allowed (an instance behind a path-routing ingress);
    query strings and credentials are not, since every leg appends its own
    path. The fragment (never sent on the wire, so it cannot be mistaken
    for part of the path) says the instance's data-parallel ranks,
    ``#dp=N`` (it serves N engines behind one port) or ``#rank=I`` (one of
    them), where it publishes its KV cache events (``kv-events=5557``,
    its replay endpoint ``kv-replay=5558``) and how many legs it takes at
    once (``max-in-flight=4``, each rank's), joined by ``&``.
    """
    url = text(value)
    parts = _http_url(url)
    if parts.query:
        raise InvalidValue(f"{url!r} must not have a query")
    if parts.username is not None or parts.password is not None:
        raise InvalidValue(f"{url!r} must not carry credentials; use --backend-api-key")
    ranks: re.Match[str] | None = None
    kv: dict[str, str] = {}
    cap: re.Match[str] | None = None
    for part in parts.fragment.split("&") if parts.fragment else ():
        if (found := _RANKS.fullmatch(part)) is not None and ranks is None:
            ranks = found
        elif (found := _KV.fullmatch(part)) is not None and found[1] not in kv:
            kv[found[1]] = _kv_where(url, found[2])
        elif (found := _CAP.fullmatch(part)) is not None and cap is None:
            cap = found
        else:
            raise InvalidValue(f"{url!r}: {_FRAGMENTS}")
    if ranks is not None and ranks[1] == "dp" and not 1 <= int(ranks[2]) <= MAX_RANKS:
        raise InvalidValue(f"{url!r}: #dp=N must be at least 1 and at most {MAX_RANKS} ranks")
    if ranks is not None and ranks[1] == "rank" and int(ranks[2]) >= MAX_RANKS:
        raise InvalidValue(f"{url!r}: #rank=I must be below {MAX_RANKS}")
    base = url.split("#", 1)[0].rstrip("/")
    fragment = [f"{ranks[1]}={int(ranks[2])}"] if ranks else []
    fragment += [f"{name}={kv[name]}" for name in ("kv-events", "kv-replay") if name in kv]
    fragment += [f"max-in-flight={int(cap[1])}"] if cap else []
    return f"{base}#{'&'.join(fragment)}" if fragment else base


#: The prefixes that make a pool member a name to resolve instead of an instance
#: (Thanos' notation): every A/AAAA record at the URL's port, or every SRV record.
DISCOVERY_PREFIXES = ("dns+", "dnssrv+")


def pool_member(value: object) -> str:
    """A pool member: an instance's URL (``backend_url``), or a DNS name that gives instances.

    ``dns+http://NAME:PORT``: each A and AAAA record of NAME is an instance at
    PORT; ``dnssrv+http://_SERVICE._tcp.NAME``: each SRV record's target and
    port is one. Path and fragment apply to each instance found.
    """
    member = text(value)
    prefix = next((p for p in DISCOVERY_PREFIXES if member.startswith(p)), None)
    if prefix is None:
        return backend_url(member)
    url = backend_url(member.removeprefix(prefix))
    port = urlsplit(url).port
    if prefix == "dns+" and port is None:
        raise InvalidValue(f"{member!r}: dns+ needs the instances' port, dns+http://NAME:PORT")
    if prefix == "dnssrv+" and port is not None:
        raise InvalidValue(f"{member!r}: dnssrv+ takes each port from its SRV record, not the URL")
    host = urlsplit(url).hostname or ""
    if _is_address(host):
        raise InvalidValue(f"{member!r}: {prefix} needs a DNS name, not an address")
    return prefix + url


def discovered_by(member: str) -> str | None:
    """``dns`` or ``dnssrv`` for a member that is a name to resolve, else None."""
    prefix = next((p for p in DISCOVERY_PREFIXES if member.startswith(p)), None)
    return prefix[:-1] if prefix else None


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


#: A Kubernetes label selector as ``kubectl -l`` takes it: equality (``a=b``,
#: ``a!=b``) and set-based (``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``) terms.
_LABEL = r"(?:[A-Za-z0-9][-A-Za-z0-9_.]*/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_TERM = re.compile(
    rf"\s*(?:{_LABEL}\s+(?:in|notin)\s+\(\s*{_VALUE}(?:\s*,\s*{_VALUE})*\s*\)"
    rf"|{_LABEL}\s*(?:==?|!=)\s*{_VALUE}|!?{_LABEL})\s*(?=,|$)"
)


def label_selector(value: object) -> str:
    """A Kubernetes label selector, checked term by term, passed to the API as given."""
    selector = text(value).strip()
    if not selector:
        raise InvalidValue("must not be empty (a selector that matches every pod is a mistake)")
    rest = selector
    while rest:
        found = _TERM.match(rest)
        if found is None or found.end() == 0:
            raise InvalidValue(f"{selector!r} is not a label selector (e.g. app=vllm,role=prefill)")
        rest = rest[found.end() :]
        if rest and not rest.startswith(","):
            raise InvalidValue(f"{selector!r} is not a label selector (e.g. app=vllm,role=prefill)")
        rest = rest[1:]
    return selector


def port_or_name(value: object) -> str:
    """A container port: a number, or the name the pod gives it (``http``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    port = text(value)
    if port.isdigit():
        if not 1 <= int(port) <= 65535:
            raise InvalidValue(f"must be a port from 1 to 65535, not {value!r}")
        return str(int(port))
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?", port) or port.isdigit():
        raise InvalidValue(f"must be a port number or an IANA port name (http), not {value!r}")
    return port


def address_port(value: object) -> str:
    """``ADDRESS:PORT`` (``[v6]:PORT``), or ``ADDRESS`` for port 53: a DNS server.

    An address, not a name: the resolver's own server cannot need resolving.
    """
    where = text(value)
    try:
        parts = urlsplit(f"//{where}")
        port = parts.port
    except ValueError:
        raise InvalidValue(f"{where!r} is not ADDRESS:PORT") from None
    if not parts.hostname or parts.path or parts.username or not _is_address(parts.hostname):
        raise InvalidValue(f"{where!r} is not ADDRESS:PORT (an IP address, e.g. 10.96.0.10:53)")
    return f"{parts.netloc.rsplit(':', 1)[0] if port else parts.netloc}:{port or 53}"


def allowed_backend(value: object) -> str:
    """A network in CIDR notation (an address alone is /32 or /128), or a host name.

    A name starting with ``*.`` allows every name under it.
    """
    allowed = text(value).strip().lower()
    try:
        return str(ipaddress.ip_network(allowed, strict=False))
    except ValueError:
        pass
    name = allowed.removeprefix("*.")
    labels = name.rstrip(".").split(".")
    if not name or not all(re.fullmatch(r"[a-z0-9_]([-a-z0-9_]*[a-z0-9])?", x) for x in labels):
        raise InvalidValue(f"{value!r} is neither a network (10.0.0.0/8) nor a host name")
    return allowed.rstrip(".")


def _kv_where(url: str, where: str) -> str:
    port = int(where.rsplit(":", 1)[-1]) if where.startswith("tcp://") else int(where)
    if not 1 <= port <= 65535:
        raise InvalidValue(f"{url!r}: a KV events port is from 1 to 65535, not {port}")
    return where.rsplit(":", 1)[0] + f":{port}" if where.startswith("tcp://") else str(port)


def instance_url(url: str) -> str:
    """What names an instance: its URL and rank, without where its KV events are."""
    base, _, fragment = url.partition("#")
    ranks = [part for part in fragment.split("&") if part.startswith(("dp=", "rank="))]
    return f"{base}#{ranks[0]}" if ranks else base


def cap_of(url: str) -> int | None:
    """The legs a declared URL says its instance takes at once (``max-in-flight=N``), or None."""
    _, _, fragment = url.partition("#")
    for part in fragment.split("&"):
        if part.startswith("max-in-flight="):
            return int(part.removeprefix("max-in-flight="))
    return None


def kv_ports(url: str) -> dict[str, str]:
    """Where a declared URL says its KV events are: ``{"kv-events": ..., "kv-replay": ...}``."""
    _, _, fragment = url.partition("#")
    return dict(part.split("=", 1) for part in fragment.split("&") if part.startswith("kv-"))


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
    """The instances a declared URL stands for: ``#dp=N`` is N ranks, ``#rank=I`` each.

    Each keeps the URL's KV event ports (the rank's own port is that plus its rank).
    """
    declared = backend_url(url)
    base, _, fragment = declared.partition("#")
    if fragment.startswith("dp="):
        ranks, _, rest = fragment.partition("&")
        tail = f"&{rest}" if rest else ""
        return [f"{base}#rank={rank}{tail}" for rank in range(int(ranks[3:]))]
    return [declared]
