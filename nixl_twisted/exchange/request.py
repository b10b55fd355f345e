"""The request an exchange serves: the client's own, or one prompt of a batch.

A batched completion runs one exchange per prompt, each writing to a
``PartRequest`` (``nixl_twisted.exchange.batch``) instead of the client:
``ExchangeRequest`` is what both offer, so an exchange, its relay and its
error endings take either, and the type checker holds them to it.
"""

from __future__ import annotations

from typing import Protocol

from twisted.web.http import HTTPChannel, Request
from twisted.web.http_headers import Headers


class ExchangeRequest(Protocol):
    """What an exchange reads of its request and writes of its answer.

    Twisted's ``Request`` is one; a batch's ``PartRequest`` another, with no
    connection of its own (``channel`` None): nothing to pause or close.
    """

    @property
    def uri(self) -> bytes: ...
    @property
    def path(self) -> bytes: ...
    @property
    def requestHeaders(self) -> Headers: ...
    @property
    def startedWriting(self) -> int: ...
    @property
    def channel(self) -> HTTPChannel | None: ...

    #: Replaced whole when a timeout's error answer is written instead.
    responseHeaders: Headers

    def getHeader(self, key: bytes, /) -> bytes | None: ...
    def setResponseCode(self, code: int, message: bytes | None = None) -> None: ...
    def write(self, data: bytes, /) -> None: ...


def connected(request: ExchangeRequest) -> Request | None:
    """The client's own request while its connection is open: what can be paused or closed.

    None for a batch's part, and for a client whose connection is gone (or whose answer
    ended: Twisted then drops its channel).
    """
    if isinstance(request, Request) and getattr(request, "channel", None) is not None:
        return request
    return None


def query_of(request: ExchangeRequest) -> str:
    """The client's query string, passed on to both legs."""
    _, mark, query = request.uri.partition(b"?")
    return ("?" + query.decode("ascii", "replace")) if mark else ""
