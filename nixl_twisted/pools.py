"""The backend pools: which prefill and decode instance serves the next leg.

``BackendService`` is the service object the twistd tree owns: it holds both
pools and the one long-lived HTTP client, and closes its connections when
the service stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from twisted.application.service import Service
from twisted.internet.defer import Deferred

from nixl_twisted.upstream import Upstream


class InvalidBackendURL(ValueError):
    """A backend URL that cannot name a vLLM instance."""


def normalize_backend_url(url: str) -> str:
    """Check a backend base URL and return it without a trailing slash.

    A path prefix is allowed (an instance behind a path-routing ingress);
    query strings, fragments and credentials are not, since every leg
    appends its own path.
    """
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError as error:
        raise InvalidBackendURL(f"{url!r} is not a valid URL: {error}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidBackendURL(f"{url!r} must start with http:// or https://")
    if not parts.hostname:
        raise InvalidBackendURL(f"{url!r} has no host")
    if parts.query or parts.fragment:
        raise InvalidBackendURL(f"{url!r} must not have a query or a fragment")
    if parts.username is not None or parts.password is not None:
        raise InvalidBackendURL(f"{url!r} must not carry credentials; use --backend-api-key")
    return url.rstrip("/")


class BackendPool:
    """Instances of one role, handed out in round-robin order (as the seed)."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"the {role} pool needs at least one instance")
        self.role = role
        self.urls: tuple[str, ...] = tuple(normalize_backend_url(u) for u in urls)
        self._cursor = 0

    def __len__(self) -> int:
        return len(self.urls)

    def next(self) -> str:
        """The instance for the next leg of this role."""
        url = self.urls[self._cursor % len(self.urls)]
        self._cursor += 1
        return url


class BackendService(Service):
    """The prefill and decode pools, and the HTTP client that reaches them."""

    name = "backends"

    def __init__(
        self,
        prefill: BackendPool,
        decode: BackendPool,
        upstream: Upstream,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.upstream = upstream

    def stopService(self) -> Deferred[None]:
        """Close every pooled backend connection before the process exits."""
        super().stopService()
        return self.upstream.close()
