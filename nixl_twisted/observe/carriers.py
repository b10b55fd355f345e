"""The W3C trace headers a request carries: what of a client's the SDK may read, and how a
leg's are written.

A client's ``traceparent``, ``tracestate`` and ``baggage`` past W3C's
limits or malformed are read as absent before the SDK sees them: the SDK
would otherwise log a warning for each, and a client could write a log
line per request (``spans`` reads and writes through these).
"""

from __future__ import annotations

import re
from urllib.parse import quote_plus, unquote_plus

from opentelemetry.propagators.textmap import Getter, Setter
from twisted.web.http_headers import Headers

#: The longest ``traceparent`` read (version 00 is 55 characters). The SDK
#: ignores a longer one too, but logs a warning for it: a client could then
#: write a log line per request. The same goes for a ``tracestate`` or a
#: ``baggage`` past W3C's limits or malformed: they are read as absent
#: before the SDK sees them, and so is any of them that is not ASCII.
MAX_TRACEPARENT = 512
#: W3C Trace Context: the ``tracestate`` a vendor must pass on whole, and its members.
MAX_TRACESTATE = 512
MAX_TRACESTATE_MEMBERS = 32
#: W3C Baggage: the whole header in bytes, its members, one member in bytes.
MAX_BAGGAGE = 8192
MAX_BAGGAGE_MEMBERS = 180
MAX_BAGGAGE_MEMBER = 4096

#: A ``tracestate`` list member (W3C Trace Context, section 3.3.1).
_TRACESTATE_KEY = (
    r"(?:[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
)
_TRACESTATE_MEMBER = re.compile(
    _TRACESTATE_KEY + r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
#: A ``baggage`` list member (W3C Baggage, section 3.3.1): ``key=value`` and properties.
_OWS = r"[ \t]*"
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_BAGGAGE_VALUE = r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*"
_PROPERTY = rf"{_TOKEN}{_OWS}(?:={_OWS}{_BAGGAGE_VALUE})?"
_BAGGAGE_MEMBER = re.compile(
    rf"{_OWS}{_TOKEN}{_OWS}={_OWS}{_BAGGAGE_VALUE}(?:{_OWS};{_OWS}{_PROPERTY})*{_OWS}"
)
#: Where one baggage member ends and the next begins (the space around a
#: comma; a member keeps any other, as the SDK reads them).
_BAGGAGE_COMMA = re.compile(r"[ \t]*,[ \t]*")


def _usable(key: str, values: list[str]) -> bool:
    """Whether the SDK may read these values of ``key``: within W3C's limits, and well formed."""
    if key == "traceparent":
        return len(values[0]) <= MAX_TRACEPARENT
    if key == "tracestate":
        header = ",".join(values)  # several lines are one list (RFC 9110, section 5.3)
        members = [m for m in (m.strip(" \t") for m in header.split(",")) if m]
        return (
            len(header) <= MAX_TRACESTATE
            and len(members) <= MAX_TRACESTATE_MEMBERS
            and all(_TRACESTATE_MEMBER.fullmatch(member) for member in members)
        )
    if key == "baggage":
        members = [m for m in _BAGGAGE_COMMA.split(values[0]) if m]  # the SDK reads line 1
        if not members:
            return True  # blanks and commas: no baggage, and nothing for the SDK to say
        if len(members) > MAX_BAGGAGE_MEMBERS or not all(map(_BAGGAGE_MEMBER.fullmatch, members)):
            return False
        # Within the limits as received and as the SDK sends it on to each leg.
        for sizes in ([len(m) for m in members], [_resent_size(m) for m in members]):
            if max(sizes) > MAX_BAGGAGE_MEMBER or sum(sizes) + len(sizes) - 1 > MAX_BAGGAGE:
                return False
    return True


def _resent_size(member: str) -> int:
    """A baggage member's length once the SDK has decoded it and encoded it again for a leg.

    It percent-decodes, then percent-encodes what it sends (``%`` becomes
    ``%25``, ``;`` ``%3B``): a baggage within the limits can grow past them,
    and the SDK would log a warning per leg.
    """
    name, _, value = member.partition("=")
    resent = (quote_plus(unquote_plus(part.strip(" \t")).strip()) for part in (name, value))
    return sum(map(len, resent)) + 1


class _HeadersGetter(Getter[Headers]):
    def get(self, carrier: Headers, key: str) -> list[str] | None:
        raw = carrier.getRawHeaders(key.encode("ascii"))
        if raw is None:
            return None
        try:
            values = [value.decode("ascii") for value in raw]
        except UnicodeDecodeError:
            return None  # none of these headers may hold anything but ASCII
        # Invalid, so absent (W3C): a traceparent's request starts a new trace.
        return values if _usable(key, values) else None

    def keys(self, carrier: Headers) -> list[str]:
        return [_text(name) for name, _ in carrier.getAllRawHeaders()]


class _HeadersSetter(Setter[Headers]):
    def set(self, carrier: Headers, key: str, value: str) -> None:
        carrier.setRawHeaders(key.encode("latin-1"), [value.encode("latin-1")])


def _text(name: bytes | str) -> str:
    return name.decode("latin-1") if isinstance(name, bytes) else name


#: How the SDK reads a client's headers and writes a leg's.
GETTER = _HeadersGetter()
SETTER = _HeadersSetter()
