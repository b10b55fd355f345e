"""A request's intake: its body checked, and held against the budget, as it arrives.

``LimitedRequest`` is the request class of the proxy's site; it sees the
site and the channel it came on only through what it needs of them
(``Intake``, ``Refusing``), so this module depends on neither.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, cast

from twisted.web.server import Request

from nixl_twisted import __version__
from nixl_twisted.observe.access import AccessLog, AccessRecord, record_of
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.web.deadlines import ClientLimits


class Intake(Protocol):
    """What a request needs of its site (``site.TrackingSite``)."""

    limits: ClientLimits
    body_budget: BodyBudget | None
    access_log: AccessLog | None

    def refused(self, reason: ErrorCode, message: str) -> None: ...


class Refusing(Protocol):
    """What a request needs of its channel: answering a refusal before any resource ran."""

    def refuse(
        self, code: ErrorCode, message: str, headers: bytes = ..., path: bytes = ...
    ) -> None: ...

    def answer_early(
        self, code: ErrorCode, message: str, headers: bytes = ..., path: bytes = ...
    ) -> None: ...


#: The ``Server`` header of every answer.
SERVER = f"nixl-twisted/{__version__}".encode("ascii")


class BodyBudget:
    """The bytes of request bodies all requests may hold at once (``--max-buffered-bodies``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class LimitedRequest(Request):
    """A request whose body is refused as soon as it is too large, or too many are held.

    ``Content-Length`` is checked before any byte of the body is read, and
    the bytes received as they arrive, so an oversized body is never
    buffered whole: 413 past ``--max-body-size`` (and the connection
    closed). The bodies all requests hold (``--max-buffered-bodies``) count
    what has arrived, not what was announced, so a slow upload cannot
    reserve bytes it never sends: past the budget, 503 with ``Retry-After``
    at once, the rest of the body read and dropped (``refuse_unread``). What
    a request holds is given back when it ends.
    """

    _refused = False
    _discarding = False
    #: When the request arrived, until its first byte is written.
    _arrived: float | None = None
    _received = 0
    _held = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: What the access event will say of this request, filled as it is served.
        self.access = AccessRecord()

    def setHeader(self, name: bytes | str, value: bytes | str) -> None:
        # Twisted's Request.process sets "Server: TwistedWeb/x.y" on every answer.
        if (name.lower() if isinstance(name, bytes) else name.lower().encode()) == b"server":
            value = SERVER
        super().setHeader(name, value)

    def _site(self) -> Intake:
        site: Intake = self.channel.site  # type: ignore[attr-defined]
        return site

    def _channel(self) -> Refusing:
        return cast(Refusing, self.channel)

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self._site().limits.max_body_size:
            self._refuse_too_large()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._discarding:
            self._drop(len(data))
            return
        if self._refused:
            return  # dropped: answered already
        self._received += len(data)
        if self._received > self._site().limits.max_body_size:
            self._refuse_too_large()
            return
        if not self._hold(len(data)):
            self._refuse_busy()
            return
        super().handleContentChunk(data)

    def chunk_announced(self, size: int) -> bool:
        """A chunk of ``size`` bytes is coming (``framing.BoundedChunks``): False, and 413 at
        once, when it would take the body past ``--max-body-size``."""
        if self._discarding or self._refused:
            return self._discarding  # (a refused body is read and dropped, or not read)
        if self._received + size <= self._site().limits.max_body_size:
            return True
        self._refuse_too_large()
        return False

    def _hold(self, size: int) -> bool:
        budget = self._site().body_budget
        if budget is None:
            return True
        if not budget.take(size):
            return False
        if not self._held:
            # (Once the request ends it has no channel, so no site: keep the budget.)
            self.notifyFinish().addBoth(lambda _: budget.give(self._held))
        self._held += size
        return True

    def write(self, data: bytes) -> None:
        if data and self._arrived is not None:
            arrived, self._arrived = self._arrived, None
            access_log = self._site().access_log
            if access_log is not None:
                access_log.first_byte(self, time.monotonic() - arrived)
        super().write(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        self._arrived = record_of(self).started = time.monotonic()
        if self._discarding:
            self.channel.loseConnection()  # the body is read (and dropped): now close
        elif not self._refused:
            super().requestReceived(command, path, version)

    def connectionLost(self, reason: Any) -> None:
        access_log = getattr(getattr(self.channel, "site", None), "access_log", None)
        abandoned = not self.finished and not self._refused and self.method != b"(no method yet)"
        super().connectionLost(reason)
        if abandoned and access_log is not None:
            access_log.request_ended(self, client_left=True)

    def _refuse_too_large(self) -> None:
        limit = self._site().limits.max_body_size
        message = f"request body is larger than the proxy's limit of {limit} bytes"
        self._site().refused(ErrorCode.REQUEST_TOO_LARGE, message)
        self._refused = True
        self._no_continue()
        self._channel().refuse(ErrorCode.REQUEST_TOO_LARGE, message)

    def _refuse_busy(self) -> None:
        message = "the proxy holds as many request bodies as it may now; try again shortly"
        self.refuse_unread(ErrorCode.REQUEST_BODIES_BUFFER_FULL, message, b"Retry-After: 1\r\n")

    def refuse_unread(
        self,
        code: ErrorCode,
        message: str,
        headers: bytes = b"",
        path: bytes = b"",
        announced: int | None = None,
    ) -> bool:
        """Refuse the request before the rest of its body is read; True while that is read.

        The answer goes now, then the rest of the body is read and dropped
        (up to ``--max-body-size``) and the connection closed: a client still
        sending would otherwise get a reset connection, not the answer. It
        closes at once when the client waits for ``100 Continue`` (no body
        follows) or ``announced`` a body past the limit (not worth reading).
        """
        self._site().refused(code, message)
        waiting = self._no_continue()
        too_large = announced is not None and announced > self._site().limits.max_body_size
        self._refused, self._discarding = True, not waiting and not too_large
        channel = self._channel()
        answer = channel.answer_early if self._discarding else channel.refuse
        answer(code, message, headers, path)
        return self._discarding

    def _drop(self, size: int) -> None:
        """Bytes of a refused body, dropped; past ``--max-body-size``, the connection closed."""
        self._received += size
        if self._received > self._site().limits.max_body_size:
            self._discarding = False
            self.channel.loseConnection()

    def _no_continue(self) -> bool:
        """Refused: no ``100 Continue`` may follow; True if the client was waiting for one.

        Twisted sends it after ``gotLength`` when the request asks for it; a
        request without the header gets none.
        """
        expected = self.requestHeaders.getRawHeaders(b"expect")
        self.requestHeaders.removeHeader(b"expect")
        return bool(expected) and not self._received
