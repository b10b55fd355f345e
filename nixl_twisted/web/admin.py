"""The admin API: list, add, drain and remove backend instances while serving.

Under ``--workers`` a change is made in the worker that got it, then
published to the others through the supervisor, and answered once they all
have it; with ``--replicas-redis``, once Redis has it too, which every
replica makes it from (``fleet.admin_changes``).

Guarded by a bearer token (``--admin-token`` or ``NIXLPROXY_ADMIN_TOKEN``);
without one configured the API does not exist (404). A missing or wrong
token is a 401, logged without the token. The same token opens the full
``/healthcheck`` and ``/metrics`` on a client endpoint while clients need a
key (``AdminAPI.shows_the_backends``).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from nixl_twisted.backends.allowed import AllowedBackends
from nixl_twisted.backends.pools import BackendPool, PoolChangeRefused
from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.values import InvalidValue, backend_url
from nixl_twisted.protocol import lowering
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import bearer_token
from nixl_twisted.web.backends_view import BackendsView
from nixl_twisted.web.front import on_admin_port

log = Logger()


class AdminAPI:
    """What ``/admin/backends`` does, apart from the routing (``ProxyApp``)."""

    def __init__(
        self,
        view: BackendsView,
        config: ProxyConfig,
        publish: Callable[[dict[str, str]], Deferred[None]] | None = None,
        tell: Callable[[dict[str, str]], Deferred[None]] | None = None,
    ) -> None:
        """``publish`` tells the other workers of a change (``run.coordination``), ``tell``
        the other replicas (``fleet.admin_changes``, with ``--replicas-redis``); alone,
        nobody is told."""
        self.view = view
        self.backends = view.backends
        self.publish = publish if publish is not None else _nobody
        self.tell = tell if tell is not None else _nobody
        self.configure(config)

    def configure(self, config: ProxyConfig) -> None:
        """The token (None: there is no admin API) and ``--allowed-backends``, from now on."""
        token = config.admin_token
        self._token = token.encode("utf-8") if token else None
        #: Where an instance the API adds may be (``--allowed-backends``).
        self.allowed = AllowedBackends(config.discovery.allowed)

    def holds_token(self, request: IRequest) -> bool:
        """The request carries the admin token (none configured: nobody does)."""
        sent = bearer_token(request.getHeader(b"authorization"))
        # In constant time: how much of a guess was right must not show.
        return (
            self._token is not None and sent is not None and hmac.compare_digest(sent, self._token)
        )

    def shows_the_backends(self, request: IRequest, config: ProxyConfig) -> bool:
        """Whether ``/healthcheck`` in full and ``/metrics`` (every instance's URL, the
        process id, last errors) may be shown to ``request`` (``docs/security.md``).

        Always on the ``--admin-listen`` endpoint, never on a client endpoint
        beside it; with no admin endpoint, to anyone while every client is
        served, and to the admin token alone once clients need a key: the
        client endpoints are then where untrusted callers are.
        """
        if on_admin_port(request):
            return True
        if config.admin_listen is not None:
            return False
        return not config.keyed or self.holds_token(request)

    def authorize(self, request: IRequest) -> None:
        if self._token is None:
            raise ProxyError(ErrorCode.NOT_FOUND, "there is no admin API here")
        if not self.holds_token(request):
            log.warn(
                "admin API refused {method} {path} from {client}: missing or wrong token",
                method=request.method.decode("ascii", "replace"),
                path=request.path.decode("utf-8", "replace"),
                client=str(request.getClientAddress()),
            )
            raise ProxyError(ErrorCode.UNAUTHORIZED, "a valid admin bearer token is required")

    def listing(self) -> dict[str, Any]:
        return self.view.instances()

    def _target(self, body: bytes) -> tuple[BackendPool, str]:
        try:  # (as strict as a client's body: no NaN, no 1e400, no bottomless nesting)
            change = lowering.read_json(body)
        except (ValueError, RecursionError):
            raise ProxyError(
                ErrorCode.INVALID_JSON, 'the body must be JSON: {"pool": ..., "url": ...}'
            ) from None
        if not isinstance(change, dict) or not isinstance(change.get("url"), str):
            raise ProxyError(ErrorCode.INVALID_BODY, 'the body must name a "url"')
        pool = self.backends.pool(str(change.get("pool")))
        if pool is None:
            raise ProxyError(ErrorCode.INVALID_POOL, '"pool" must be "prefill" or "decode"')
        try:
            # The same check as a --prefill or --decode URL gets.
            return pool, backend_url(change["url"])
        except InvalidValue as error:
            raise ProxyError(ErrorCode.INVALID_URL, str(error)) from None

    def add(self, body: bytes) -> Deferred[dict[str, Any]]:
        return self._change("add", body)

    def drain(self, body: bytes) -> Deferred[dict[str, Any]]:
        return self._change("drain", body)

    def remove(self, body: bytes) -> Deferred[dict[str, Any]]:
        return self._change("remove", body)

    def _change(self, op: str, body: bytes) -> Deferred[dict[str, Any]]:
        pool, url = self._target(body)
        refusal = self.allowed.refusal(url) if op == "add" else None
        if refusal is not None:
            raise ProxyError(ErrorCode.BACKEND_NOT_ALLOWED, refusal)
        try:
            instances = self.backends.apply_change({"op": op, "pool": pool.role, "url": url})
        except PoolChangeRefused as error:
            raise ProxyError(ErrorCode.LAST_INSTANCE, str(error)) from None
        if not instances:
            raise ProxyError(ErrorCode.NOT_FOUND, f"no {pool.role} instance {url}")
        described = [self.view.status(instance) for instance in instances]
        # One instance: its description; the ranks of URL#dp=N: each of theirs.
        answer = described[0] if len(described) == 1 else {"instances": described}
        # Answered once every worker has the change too, and the fleet's Redis.
        change = {"op": op, "pool": pool.role, "url": url}
        published = self.publish(change)
        published.addCallback(lambda _: self.tell(change))
        return published.addCallback(lambda _: answer)


def _nobody(change: dict[str, str]) -> Deferred[None]:
    """Alone: no other worker to tell of a change."""
    return succeed(None)
