"""The pool's connections to backends: quiet in the log, their answers' heads bounded.

Twisted's client parser reads any number of header lines: a broken or
hostile backend's 100,000 headers were held (300 KB read, 52 MB of
``Headers``) and relayed to the client. Each connection here fails an
answer whose head is past the bound (``HeadTooLarge``, the leg's 502).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web._newclient import HTTP11ClientProtocol
from twisted.web.client import _HTTP11ClientFactory
from twisted.web.iweb import IResponse


class QuietFactory(_HTTP11ClientFactory):
    """Twisted's factory for one pooled connection, without its "Starting factory" line.

    Each backend connection logged two info lines (starting, stopping),
    most of a busy proxy's log. (A private class and hook of
    ``HTTPConnectionPool``: ``test_no_factory_chatter`` notices if they go.)
    Its connections bound an answer's head (``_BoundedHead``).
    """

    noisy = False

    def buildProtocol(self, addr: Any) -> HTTP11ClientProtocol:
        return _BoundedHead(self._quiescentCallback)


#: The most header lines, and bytes of status line and headers, a backend's answer may have:
#: vLLM sends about ten lines (nginx's proxy buffer for an upstream's head is 4 or 8 KB).
MAX_HEADER_LINES = 100
MAX_HEAD_BYTES = 64 * 1024


class HeadTooLarge(Exception):
    """A backend answered more header lines or bytes than the proxy reads."""


class _BoundedHead(HTTP11ClientProtocol):
    """Twisted's client connection, whose answers' heads are bounded.

    Twisted's parser takes any number of headers: 100,000 from a broken
    decode were held (300 KB read, 52 MB of ``Headers``) and relayed. Each
    line of a head is counted as the parser reads it; past the bound the
    answer fails with ``HeadTooLarge`` (the leg's 502) and the connection
    is closed. (``HTTP11ClientProtocol._parser``: a private name,
    ``docs/architecture.md``.)
    """

    def request(self, request: Any) -> Deferred[IResponse]:
        sent = super().request(request)
        parser = self._parser
        if parser is not None:
            parser.lineReceived = _counted(parser.lineReceived)  # type: ignore[method-assign]
        return sent


def _counted(read: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """``read`` (a parser's ``lineReceived``, called for a head's lines only), bounded."""
    lines = size = 0

    def line(received: bytes) -> None:
        nonlocal lines, size
        lines, size = lines + 1, size + len(received) + 1
        if lines > MAX_HEADER_LINES + 1 or size > MAX_HEAD_BYTES:  # (+1: the status line)
            raise HeadTooLarge(
                f"the answer's head is longer than {MAX_HEADER_LINES} header lines or "
                f"{MAX_HEAD_BYTES} bytes"
            )
        read(received)

    return line
