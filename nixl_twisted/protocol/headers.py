"""Which headers cross the proxy, in each direction (RFC 9110 section 7.6.1).

Pure functions over ``twisted.web.http_headers.Headers``. Of what the client
sent, both legs carry what the protocol names (its ``Authorization``) and
W3C trace context, which vLLM reads to join the client's trace, plus the
headers the operator names (``--forward-header``); the rest is for the proxy
or for nobody. What decode answered comes back except what is hop-by-hop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from twisted.web.http_headers import Headers

from nixl_twisted.protocol.lowering import new_request_id

#: Hop-by-hop headers: they describe one connection, never the message.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

#: Request headers the proxy sets itself on each leg, or never sends. The
#: client's ``accept-encoding`` is dropped: the proxy must read prefill's
#: answer and relays decode's decoded, so each leg carries treq's ``gzip``
#: (its ``ContentDecoderAgent`` decodes it) and the client gets identity.
#: Only the proxy says which data-parallel rank serves a leg (and only to an
#: instance declared ``#dp=N``); ``expect`` was answered by the proxy itself.
_PROXY_OWNED_REQUEST = frozenset(
    {
        b"host",
        b"content-length",
        b"content-type",
        b"accept-encoding",
        b"x-request-id",
        b"x-data-parallel-rank",
        b"expect",
    }
)

#: Where a client's key to the proxy travels (``x-api-key``: Anthropic's clients):
#: the headers that say who a client is, with the tenant header the operator names.
IDENTITY = (b"Authorization", b"x-api-key")
_CLIENT_KEYS = frozenset(name.lower() for name in IDENTITY)

#: The client's headers each leg carries: its key (``docs/protocol.md``), unless
#: clients key the proxy itself, and W3C trace context. Nothing else: a ``Cookie`` or a
#: ``Range`` means nothing to vLLM, and ``Forwarded`` or ``X-Forwarded-For`` would claim
#: an origin the proxy never checked.
FORWARDED = frozenset({b"authorization", b"traceparent", b"tracestate", b"baggage"})

REQUEST_ID = b"X-Request-Id"
AUTHORIZATION = b"Authorization"

#: A client's ``X-Request-Id`` the proxy keeps: one token of 1 to 128 letters,
#: digits and ``._:-`` (a UUID, a ULID, a gateway's trace id), nothing a log
#: line or a header could be forged with.
_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def conflicting(client: Headers, names: Iterable[bytes]) -> bytes | None:
    """The first of ``names`` the client sent twice with different values, else None.

    Such a request is refused (``conflicting_headers``), not read by one rule
    or another: a gateway that adds its own value after a client's, or
    before it, would otherwise let the client choose who it is.
    """
    for name in names:
        values = client.getRawHeaders(name)
        if values is not None and len(values) > 1 and len(set(values)) > 1:
            return name
    return None


def said_twice(name: bytes) -> str:
    """The refusal's message for a header ``conflicting`` found."""
    return f"the request sends {name.decode('ascii')} more than once, with different values"


def request_id_of(client: Headers) -> str:
    """The request's id: the client's ``X-Request-Id`` when it is one sane token, else
    a fresh one (also when the client sent several that differ)."""
    sent = client.getRawHeaders(REQUEST_ID)
    if sent and len(set(sent)) == 1 and _CLIENT_REQUEST_ID.fullmatch(sent[0]):
        return sent[0].decode("ascii")
    return new_request_id()


def _connection_tokens(headers: Headers) -> frozenset[bytes]:
    """Header names a ``Connection`` header declares hop-by-hop."""
    tokens: set[bytes] = set()
    for value in headers.getRawHeaders(b"connection", []):
        tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(tokens)


def _end_to_end(
    headers: Headers, also_drop: frozenset[bytes], only: frozenset[bytes] | None = None
) -> Headers:
    """``headers`` but the hop-by-hop ones and ``also_drop`` (``only``: of these names)."""
    drop = HOP_BY_HOP | _connection_tokens(headers) | also_drop
    kept = Headers()
    for name, values in headers.getAllRawHeaders():
        lowered = name.lower()
        if lowered in drop or (only is not None and lowered not in only):
            continue
        if lowered == b"content-encoding" and not any(v.strip() for v in values):
            # Twisted's content decoder leaves an empty value behind when
            # there was nothing to decode; an empty coding is not a header.
            continue
        kept.setRawHeaders(name, list(values))
    return kept


def backend_request_headers(
    client: Headers,
    request_id: str,
    backend_api_key: str | None,
    json_body: bool = True,
    keyed: bool = False,
    forwarded: Iterable[str] = (),
) -> Headers:
    """The headers a backend call carries: the client's ``FORWARDED`` ones and those named
    in ``forwarded`` (``--forward-header``), plus ours.

    The client's ``Authorization`` wins; the operator's backend key is used
    only when the client sent none. ``keyed``: clients authenticate to the
    proxy (``--api-key``), so their key stays here and vLLM gets the backend
    key alone. A header that is hop-by-hop or the proxy's own is never the
    client's to send on, named or not.
    """
    named = FORWARDED | {name.lower().encode("ascii") for name in forwarded}
    kept = named - _PROXY_OWNED_REQUEST - (_CLIENT_KEYS if keyed else frozenset())
    headers = _end_to_end(client, frozenset(), kept)
    if json_body:
        headers.setRawHeaders(b"Content-Type", [b"application/json"])
    headers.setRawHeaders(REQUEST_ID, [request_id.encode("ascii")])
    if backend_api_key and not headers.hasHeader(AUTHORIZATION):
        headers.setRawHeaders(AUTHORIZATION, [b"Bearer " + backend_api_key.encode("utf-8")])
    return headers


#: Which engine of a data-parallel vLLM serves the request.
DP_RANK = b"X-data-parallel-rank"


def for_rank(headers: Headers, rank: int | None) -> Headers:
    """A leg's headers: to one rank of a data-parallel instance, with its rank header."""
    if rank is None:
        return headers
    ranked = headers.copy()
    ranked.setRawHeaders(DP_RANK, [str(rank).encode("ascii")])
    return ranked


#: Response headers the proxy sets itself: its request id wins over one a
#: backend echoes back (vLLM may append a suffix of its own); ``Server`` and
#: ``Date`` are the proxy's, as the one that answers (vLLM's say uvicorn).
_PROXY_OWNED_RESPONSE = frozenset({b"x-request-id", b"server", b"date"})


def client_response_headers(backend: Headers) -> Headers:
    """The headers of a backend answer that are relayed to the client."""
    return _end_to_end(backend, _PROXY_OWNED_RESPONSE)


def bearer_token(credentials: bytes | None) -> bytes | None:
    """The token of ``Bearer TOKEN``, else None (no other scheme carries a key or the admin
    token).

    As RFC 9110 section 11 has it: the scheme in any case, then one or more spaces.
    """
    scheme, space, token = (credentials or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not space:
        return None
    return token.lstrip(b" ")
