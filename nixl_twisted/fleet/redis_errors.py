"""Why the proxy could not use a Redis, in words, and what fixes the URL when it is wrong.

Some failures pass (Redis not up yet, a connection refused while it restarts); others
are a mistake in the URL that no retry mends: Redis asks for a password the URL does
not give (``NOAUTH``), refuses the one it gives (``WRONGPASS``), the host name is not
known, the certificate is refused, a TLS port is spoken to in plain text. For those
``fix_for`` names the fix, so that the one line said at start is enough to act on.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from twisted.internet import error
from twisted.python.failure import Failure

#: Where a password may be given (the URL's own, or the environment's).
_PASSWORD = "in the URL (redis://:PASSWORD@HOST:PORT) or in $NIXLPROXY_REPLICAS_REDIS"


def unreachable(failure: Failure, url: str) -> str:
    """Why a connection to ``url``'s Redis could not be made, in words."""
    parts = urlsplit(url)
    where = f"{parts.hostname}:{parts.port or 6379}"
    if failure.check(error.DNSLookupError):
        return f"the host name {parts.hostname} is not known"
    if failure.check(error.ConnectionRefusedError):
        return f"the connection to {where} was refused (is Redis listening there?)"
    if failure.check(error.TimeoutError, error.TCPTimedOutError):
        return f"the connection to {where} timed out"
    return f"the connection to {where} failed ({failure.getErrorMessage()})"


def fix_for(said: str, url: str) -> str | None:
    """What fixes ``url`` when Redis failed as ``said`` says and no retry will mend it;
    None when it may pass by itself."""
    text = said.lower()
    tls = urlsplit(url).scheme == "rediss"
    if "noauth" in text:
        return f"Redis asks for a password: give it {_PASSWORD}"
    if "wrongpass" in text or "invalid password" in text or "invalid username" in text:
        return f"Redis refused the password: give the right one {_PASSWORD}"
    if "without any password configured" in text:
        return "Redis has no password: take the password out of the URL"
    if "is not known" in text:
        return "check the host name in the URL"
    if tls and ("certificate" in text or "name mismatch" in text):
        return (
            "Redis's certificate was refused: check that the URL's host is the name its "
            "certificate is for, and give its CA with ?ssl_ca_certs=PATH when the system's "
            "do not sign it"
        )
    if tls and "tls with" in text:
        return "the port did not speak TLS: use redis:// for a plain port, rediss:// for TLS"
    if not tls and ("lost connection" in text or "closed during" in text):
        # (a TLS port closes a plain connection at its first command: AUTH, or SELECT)
        return "Redis closed the connection unanswered: use rediss:// if the port speaks TLS"
    return None
