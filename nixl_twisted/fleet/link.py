"""A connection to Redis (``--replicas-redis``, ``--limits-redis``): txredisapi's, made
again when it gives up.

txredisapi reconnects on its own when a connection cannot be made or is
lost, but when Redis refuses one (``AUTH`` or ``SELECT`` answered with an
error such as "max number of clients reached", with garbage, or not at all)
it stops trying for good. ``RedisLink`` then opens a new one ``RETRY`` s
later on the proxy's clock, and again after each refusal, so what it serves
comes back once Redis lets the proxy in. txredisapi is imported only here,
when the option is set (it would install a reactor at import).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.python.failure import Failure
from zope.interface import implementer

from nixl_twisted.fleet.redis_errors import unreachable
from nixl_twisted.fleet.redis_tls import endpoint, verified

#: Seconds before a connection that Redis refused is made again.
RETRY = 1.0
#: Seconds a connection's handshake, or any call on it, may go unanswered before
#: the connection is closed (a server that sends garbage would hold it for good).
SILENCE = 1.0

_HANDSHAKE = re.compile(r"(?:Redis error: )?could not (auth|set dbid=(\d+)): (.*)", re.S)


class RedisLink:
    """One connection to Redis, for calls while it is open; refusals said in words."""

    def __init__(
        self, url: str, clock: IReactorTime, refused: Callable[[str], None], reactor: Any = None
    ) -> None:
        """``clock``: the proxy's, for the wait before a refused connection is made
        again; ``refused``: told why each time Redis refuses one; ``reactor``: the proxy's,
        to connect on (None: txredisapi's global one)."""
        self.url = url
        self.clock = clock
        self.reactor = reactor
        self.on_refused = refused
        self.redis: Any = None
        self._retry: IDelayedCall | None = None
        self._stopped = False
        self._connected: list[Deferred[None]] = []
        self._refused: list[Deferred[str]] = []
        #: Why the latest connection could not be made, in words (None since one was).
        self.unreachable: str | None = None

    @property
    def open(self) -> bool:
        """Whether a connection is open and ready now (a call would be sent at once)."""
        # (txredisapi's handler keeps its factory private; its size is the
        # connections that passed their handshake and are open now)
        return bool(self.redis is not None and self.redis._factory.size)

    def start(self) -> None:
        self.redis = self._connect()

    def _connect(self) -> Any:
        return _connect(
            _Noted(endpoint(self.url, 1, self.reactor), self._failed),
            self.url,
            self._opened,
            self._gave_up,
        )

    def _failed(self, failure: Failure) -> None:
        self.unreachable = unreachable(failure, self.url)

    def stop(self) -> Deferred[None]:
        if self._stopped:
            return succeed(None)
        self._stopped = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        closing: Deferred[None] = self.redis.disconnect()
        return closing.addErrback(lambda _: None)

    def eval(self, script: str, keys: list[str], args: list[object]) -> Deferred[Any]:
        """Run ``script`` (by its SHA-1 once Redis knows it), waiting for a connection."""
        sent: Deferred[Any] = self.redis.eval(script, keys, args)
        return sent

    def command(self, *args: object) -> Deferred[Any]:
        """Any other command (``XREAD``, ``TIME``), waiting for a connection."""
        sent: Deferred[Any] = self.redis.execute_command(*args)
        return sent

    def connected(self) -> Deferred[None]:
        """Fires when a connection to Redis is next made (for tests and operators)."""
        waiting: Deferred[None] = Deferred()
        self._connected.append(waiting)
        return waiting

    def refused(self) -> Deferred[str]:
        """Fires with why, in words, when Redis next refuses a connection."""
        waiting: Deferred[str] = Deferred()
        self._refused.append(waiting)
        return waiting

    def _opened(self) -> None:
        self.unreachable = None
        waiting, self._connected = self._connected, []
        for each in waiting:
            each.callback(None)

    def _gave_up(self, why: str) -> None:
        said = handshake_failure(why)
        if self._stopped:
            return  # (its handshake cut short by the stop)
        if self._retry is None or not self._retry.active():
            self._retry = self.clock.callLater(RETRY, self._again)
        self.unreachable = said
        self.on_refused(said)
        waiting, self._refused = self._refused, []
        for each in waiting:
            each.callback(said)

    def _again(self) -> None:
        given_up, self.redis = self.redis, self._connect()
        given_up.disconnect().addErrback(lambda _: None)  # (closed already: its pool, tidied)


def handshake_failure(why: str) -> str:
    """txredisapi's reason for giving up on a connection, in words."""
    found = _HANDSHAKE.fullmatch(why)
    if found is None:
        return why.removeprefix("Redis error: ")
    step = "AUTH" if found[1] == "auth" else f"SELECT {found[2]}"
    said = found[3]
    if said.startswith("Not received Redis response"):
        return f"{step} got no answer within {SILENCE:g} s"
    if said == "Lost connection":
        return f"the connection closed during {step}"
    return f"{step} failed: {said}"


@implementer(IStreamClientEndpoint)
class _Noted:
    """An endpoint that tells ``failed`` why each connection could not be made (txredisapi
    tries again in silence)."""

    def __init__(self, inner: Any, failed: Callable[[Failure], None]) -> None:
        self.inner = inner
        self.failed = failed

    def connect(self, factory: Any) -> Deferred[Any]:
        connecting: Deferred[Any] = self.inner.connect(factory)

        def noted(failure: Failure) -> Failure:
            if not failure.check(CancelledError):
                self.failed(failure)
            return failure

        return connecting.addErrback(noted)


def _connect(
    to: Any, url: str, connected: Callable[[], None], refused: Callable[[str], None]
) -> Any:
    """txredisapi's lazy connection through the endpoint ``to``, telling ``connected`` when
    one is made and ``refused`` why it gave up (for ``rediss://``, a certificate it did not
    trust too)."""
    txredisapi = importlib.import_module("txredisapi")
    parts = urlsplit(url)
    database = parts.path.strip("/")
    factory = txredisapi.RedisFactory(
        f"{parts.hostname}:{parts.port or 6379}",
        int(database) if database else None,
        1,
        # (not lazy: its own line on each refusal would repeat every RETRY s; ours is said once)
        isLazy=False,
        password=unquote(parts.password) if parts.password else None,
        username=unquote(parts.username) if parts.username else None,
        replyTimeout=SILENCE,
    )
    if parts.scheme == "rediss":

        class Refusing(verified(factory.protocol, parts.hostname or "")):  # type: ignore[misc]
            def refused_by_tls(self, why: str) -> None:
                self.factory.stopTrying()  # (as txredisapi does when AUTH is refused)
                self.factory.connectionError(why)

        factory.protocol = Refusing
    # Back within a second of Redis, not txredisapi's ten.
    factory.initialDelay, factory.maxDelay = 0.1, 1.0
    added = factory.addConnection

    def addConnection(connection: Any) -> None:
        added(connection)
        if factory.size:
            connected()

    factory.addConnection = addConnection
    # (in place of failing a Deferred of its own that nobody holds)
    factory.connectionError = refused
    factory.startConnecting(to)
    return factory.handler
