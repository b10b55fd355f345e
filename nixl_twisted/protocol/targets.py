"""A request's first-token target: which headers name it, and what a value must be.

A client (or the gateway before the proxy) may ask for its first token
within so many ms. The proxy reads the names its peers read, so a request
routed through llm-d or Dynamo keeps its target: ``x-slo-ttft-ms``,
llm-d's ``x-llm-d-slo-ttft-ms``, Dynamo's ``x-dynamo-meta-slo-ttft-ms``
(and ``x-dynamo-slo-ttft-ms``, its DEP's spelling), the first present in
that order. A value is Dynamo's rule: a whole number of ms, above 0, at
most an hour; anything else is refused (400), never read as no target.
These headers are the proxy's: no leg carries them (``headers.FORWARDED``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from twisted.web.http_headers import Headers

from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

#: The headers that name a target, first read first.
TTFT_HEADERS = (
    b"x-slo-ttft-ms",
    b"x-llm-d-slo-ttft-ms",
    b"x-dynamo-meta-slo-ttft-ms",
    b"x-dynamo-slo-ttft-ms",
)

#: The longest target a request may ask for (Dynamo's bound: an hour).
MAX_TTFT_MS = 3_600_000

#: Where a target came from when no header named one: the request's tenant.
FROM_TENANT = "tenant"


def kept_as(name: bytes) -> bytes:
    """``name`` as ``Headers`` keeps it in its own table (its ``_rawHeaders``' key): a door
    that looks there reads a header without a call."""
    table = Headers()
    table.setRawHeaders(name, [b""])
    (kept,) = table._rawHeaders
    return kept


_WHOLE_MS = re.compile(rb"[0-9]{1,7}")


class Target(NamedTuple):
    """A first-token target: ``ms`` after the request's arrival, and where it came from
    (the header's name, or ``tenant``)."""

    ms: int
    came_from: str


def ttft_target(sent: Headers) -> Target | None:
    """The target the first of ``TTFT_HEADERS`` present in ``sent`` names, else None; a
    ``ProxyError`` (400) naming the header for a value that is not one (or a header sent
    twice with different values)."""
    for name in TTFT_HEADERS:
        values = sent.getRawHeaders(name)
        if values:
            return Target(_ms(name, values), name.decode("ascii"))
    return None


def _ms(name: bytes, values: Sequence[bytes]) -> int:
    shown = name.decode("ascii")
    if len(set(values)) > 1:
        message = f"the request sends {shown} more than once, with different values"
        raise ProxyError(ErrorCode.INVALID_TTFT_TARGET, message)
    value = values[0].strip(b" \t")
    if _WHOLE_MS.fullmatch(value) is None or not 0 < int(value) <= MAX_TTFT_MS:
        message = f"{shown} must be a whole number of ms above 0 and at most {MAX_TTFT_MS}"
        raise ProxyError(ErrorCode.INVALID_TTFT_TARGET, message)
    return int(value)
