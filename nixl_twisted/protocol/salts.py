"""vLLM's ``cache_salt``: read from a client's body once, and a tenant's put in front of it.

vLLM hashes a request's ``cache_salt`` into the first block of its prompt,
so requests with different salts never share prefix-cache blocks (and
never leak to each other, through a first token's time, which prefixes
another sent). A client's salt is checked at the door as vLLM checks it
(a 400 before any leg, not two legs' worth of vLLM refusing it). A
tenant's own salt (``[tenants.NAME] cache-salt``, or one derived from its
name with ``--tenant-salt-secret-file``) is combined with a client's,
never replaced by it: the client may split its tenant's namespace further,
never reach into another tenant's. Pure.
"""

from __future__ import annotations

import hashlib
import hmac

from nixl_twisted.config.tenants import cache_salt
from nixl_twisted.config.values import InvalidValue
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.lowering import JSONObject

FIELD = "cache_salt"


def client_salt(body: JSONObject) -> str | None:
    """The body's ``cache_salt`` (None: absent or null, as vLLM takes it); a ``ProxyError``
    (400 ``invalid_cache_salt``) for one vLLM would refuse."""
    value = body.get(FIELD)
    if value is None:
        return None
    try:
        return cache_salt(value)
    except InvalidValue as error:
        raise ProxyError(ErrorCode.INVALID_CACHE_SALT, f"'cache_salt' {error}") from None


def combined(tenant: str, client: str | None) -> str:
    """The salt a tenant's request is sent with: the tenant's, or with the client's own, a
    SHA-256 of both (64 hex characters, within vLLM's 128), which no client of another tenant
    can make."""
    if client is None:
        return tenant
    return hashlib.sha256(f"{tenant}\0{client}".encode("utf-8", "surrogatepass")).hexdigest()


def derived(secret: bytes, tenant: str) -> str:
    """A tenant's salt from its name and the operator's secret: HMAC-SHA256, as hex.

    Stable across restarts, replicas and workers (the same secret gives
    every proxy the same salt, so a tenant keeps its cache), and not
    guessable from the tenant's name without the secret.
    """
    return hmac.new(secret, tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
