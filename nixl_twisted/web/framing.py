"""A request's framing as the door accepts it: its header fields and its chunks.

Twisted's HTTP server is lenient where a proxy must not be: a
``Transfer-Encoding`` of ``chunked`` then ``identity`` is read as chunked
(RFC 9112 section 6.3: the final coding decides, and a request whose final
coding is not chunked has no length a server can trust), a chunk size of
any number of hex digits is taken, and a header value may hold control
bytes a backend then receives. Two readers that frame one message
differently are how requests are smuggled; the site's channel
(``site._TrackedChannel``) asks here, and refuses with 400 what is refused.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.web.http import _ChunkedTransferDecoder

#: Bytes no field value may hold (RFC 9110 section 5.5: VCHAR, obs-text, SP and HTAB only).
_CONTROLS = bytes(range(0x00, 0x09)) + bytes(range(0x0A, 0x20)) + b"\x7f"
_TRANSFER_ENCODING = b"transfer-encoding"
_FRAMING = frozenset({_TRANSFER_ENCODING, b"content-length"})
#: A chunk size longer than this many hex digits (past 64 bits) is not a size.
CHUNK_SIZE_DIGITS = 16
_HEX = frozenset(b"0123456789abcdefABCDEF")


def header_problem(line: bytes, framed: bool) -> str | None:
    """Why the header ``line`` (``name: value``) is refused with 400, else None.

    ``framed``: the request's length was already given (a ``Content-Length``
    or a ``Transfer-Encoding``). What is not a header line at all is left to
    Twisted, which refuses it too.
    """
    name, colon, value = line.partition(b":")
    if not colon:
        return None
    value = value.strip(b" \t")
    if len(value.translate(None, _CONTROLS)) != len(value):
        return "a header's value holds a control character (RFC 9110 section 5.5)"
    lowered = name.lower()
    if lowered in _FRAMING and framed:
        return (
            "the request's length is given twice (Transfer-Encoding and Content-Length, or "
            "either one twice: RFC 9112 section 6)"
        )
    if lowered == _TRANSFER_ENCODING and value.lower() != b"chunked":
        return (
            "a request's Transfer-Encoding must be chunked, once (RFC 9112 section 6.1: "
            "its final coding must be chunked, and the proxy applies no other)"
        )
    return None


class BoundedChunks(_ChunkedTransferDecoder):
    """Twisted's chunked decoder, that refuses a chunk it could never take before its bytes.

    A size longer than ``CHUNK_SIZE_DIGITS`` hex digits is malformed
    (``malformed``, a 400); a chunk larger than what the request may still
    send is announced to ``announced`` (the request's 413 past
    ``--max-body-size``), which says whether to read on. Once refused, the
    rest is dropped: the channel closes the connection.
    """

    def __init__(
        self,
        data: Callable[[bytes], None],
        finished: Callable[[bytes], None],
        malformed: Callable[[str], None],
        announced: Callable[[int], bool],
    ) -> None:
        super().__init__(data, finished)
        self._malformed = malformed
        self._announced = announced

    def _dataReceived_CHUNK_LENGTH(self) -> bool:
        digits = 0
        for byte in self._buffer[: CHUNK_SIZE_DIGITS + 1]:
            if byte not in _HEX:
                break
            digits += 1
        if digits > CHUNK_SIZE_DIGITS:
            self._refused()
            self._malformed(f"a chunk size is longer than {CHUNK_SIZE_DIGITS} hex digits")
            return False
        if not super()._dataReceived_CHUNK_LENGTH():
            return False
        if self.state == "BODY" and not self._announced(self.length):
            self._refused()
            return False
        return True

    def _refused(self) -> None:
        self.state = "REFUSED"
        del self._buffer[:]

    def _dataReceived_REFUSED(self) -> bool:
        del self._buffer[:]  # (the connection is closing: nothing more is read)
        return False
