"""What a Redis that cannot be used says (``fleet.redis_errors``): the cause of a connection
not made, and the fix for each mistake in the URL that no retry mends, none for what may
pass by itself."""

from __future__ import annotations

import pytest
from twisted.internet import error
from twisted.python.failure import Failure

from nixl_twisted.fleet.link import handshake_failure
from nixl_twisted.fleet.redis_errors import fix_for, unreachable

URL = "redis://redis.example:6379/0"
TLS = "rediss://redis.example:6380/0"


def test_a_connection_not_made_names_its_cause() -> None:
    lookup = Failure(error.DNSLookupError("no results for hostname lookup: redis.example"))
    assert unreachable(lookup, URL) == "the host name redis.example is not known"
    refused = unreachable(Failure(error.ConnectionRefusedError()), URL)
    assert refused == "the connection to redis.example:6379 was refused (is Redis listening there?)"


@pytest.mark.parametrize(
    ("url", "said", "fix"),
    [
        (
            URL,
            handshake_failure("Redis error: could not set dbid=0: NOAUTH Authentication required."),
            "Redis asks for a password",
        ),
        (
            URL,
            "answered with an error (NOAUTH Authentication required.)",
            "Redis asks for a password",
        ),
        (
            URL,
            handshake_failure(
                "Redis error: could not auth: WRONGPASS invalid "
                "username-password pair or user is disabled."
            ),
            "Redis refused the password",
        ),
        (
            URL,
            "AUTH failed: ERR AUTH <password> called without any password configured for "
            "the default user",
            "Redis has no password",
        ),
        (
            URL,
            "could not be reached: the host name redis.example is not known",
            "check the host name",
        ),
        (
            TLS,
            "TLS with redis.example failed: certificate verify failed",
            "Redis's certificate was refused",
        ),
        (
            TLS,
            "TLS: the server's certificate is not for redis.example (name mismatch)",
            "Redis's certificate was refused",
        ),
        (TLS, "TLS with redis.example: no handshake within 1 s", "use redis:// for a plain"),
        (URL, "could not be reached (Lost connection)", "use rediss:// if the port speaks TLS"),
        (URL, "the connection closed during AUTH", "use rediss:// if the port speaks TLS"),
    ],
)
def test_a_mistake_in_the_url_names_its_fix(url: str, said: str, fix: str) -> None:
    found = fix_for(said, url)
    assert found is not None and fix in found, found


def test_a_password_is_given_in_the_url_or_the_environment() -> None:
    fix = fix_for("answered with an error (NOAUTH Authentication required.)", URL)
    assert fix is not None
    assert "redis://:PASSWORD@HOST:PORT" in fix and "$NIXLPROXY_REPLICAS_REDIS" in fix


@pytest.mark.parametrize(
    "said",
    [
        "could not be reached: the connection to redis.example:6379 was refused",
        "did not answer within 1000 ms",
        "refused the connection (AUTH failed: ERR max number of clients reached)",
    ],
)
def test_what_may_pass_by_itself_has_no_fix(said: str) -> None:
    assert fix_for(said, URL) is None
