"""A subscription to one Redis channel, made again whenever its connection is lost.

The replicas tell each other what changed (``scripts``: slots freed, the
fleet's view of them) on a channel; a replica that misses messages while its
subscription is down loses nothing but time: its heartbeat reads the whole
view every second, and a waiting request is tried again each second anyway.
txredisapi is imported only here and in ``link``, when ``--replicas-redis``
is set.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from twisted.logger import Logger

from nixl_twisted.fleet.redis_tls import endpoint, verified

log = Logger()


class Channel:
    """Every message of ``name`` on the Redis at ``url``, told to ``heard`` as text."""

    def __init__(self, reactor: Any, url: str, name: str, heard: Callable[[str], object]) -> None:
        self.reactor = reactor
        self.url = url
        self.name = name
        self.heard = heard
        self._factory: Any = None

    def start(self) -> None:
        txredisapi = importlib.import_module("txredisapi")
        parts = urlsplit(self.url)
        heard, name = self.heard, self.name

        base = txredisapi.SubscriberProtocol
        if parts.scheme == "rediss":  # (a refusal is said by the link to the same Redis)
            base = verified(base, parts.hostname or "")

        class Listening(base):  # type: ignore[valid-type,misc]
            def messageReceived(self, pattern: Any, channel: Any, message: Any) -> None:
                text = message.decode("utf-8", "replace") if isinstance(message, bytes) else message
                try:
                    heard(str(text))
                except Exception:
                    log.failure("a message on {channel} was not taken", channel=name)

        factory = self._factory = txredisapi.SubscriberFactory()
        factory.protocol = Listening
        factory.password = unquote(parts.password) if parts.password else None
        factory.username = unquote(parts.username) if parts.username else None
        factory.initialDelay, factory.maxDelay = 0.1, 1.0
        added = factory.addConnection

        def subscribed(connection: Any) -> None:
            added(connection)
            connection.subscribe(name).addErrback(lambda _: None)

        factory.addConnection = subscribed
        factory.startConnecting(endpoint(self.url, 1, self.reactor))

    def stop(self) -> Any:
        """Stop listening: the connection closed, none made again."""
        if self._factory is None:
            return None
        closing = self._factory.disconnect()
        return closing.addErrback(lambda _: None)
