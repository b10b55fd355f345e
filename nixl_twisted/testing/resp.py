"""``ScriptedRedis``: a raw socket on loopback speaking Redis's protocol (RESP) as a test says.

For tests of a Redis client against a server that misbehaves where a real
``redis-server`` will not: a handshake answered with garbage, a script
answered with a reply of the wrong shape, a call never answered. Each
command (an array of bulk strings, as clients send them, or an inline line)
is answered with the raw bytes its name maps to in
:attr:`ScriptedRedis.answers`, ``+OK`` when it is not there, and nothing
when it maps to ``b""``; the bytes are sent as they are, so anything can be.
A test changes the table while the server runs, and waits for a client with
:meth:`ScriptedRedis.connected` instead of sleeping.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure

OK = b"+OK\r\n"
#: What a command too big or not RESP is answered, before the connection is closed.
PROTOCOL_ERROR = b"-ERR Protocol error\r\n"
#: The most a command may hold, in bytes (a test's commands are small).
MAX_COMMAND = 1 << 20


class ProtocolError(Exception):
    """What a client sent is not a command."""


def read_command(data: bytes) -> tuple[list[bytes], int] | None:
    """The first whole command in ``data`` and the bytes it took; None: not all there yet."""
    end = data.find(b"\r\n")
    if end < 0:
        if len(data) > MAX_COMMAND:
            raise ProtocolError("a line without its end")
        return None
    if not data.startswith(b"*"):
        return data[:end].split(), end + 2  # (an inline command, as redis-cli may send)
    count = _number(data[1:end])
    arguments: list[bytes] = []
    at = end + 2
    for _ in range(count):
        end = data.find(b"\r\n", at)
        if end < 0:
            return None
        if data[at : at + 1] != b"$":
            raise ProtocolError(f"expected a bulk string, got {data[at:end]!r}")
        length = _number(data[at + 1 : end])
        start = end + 2
        if len(data) < start + length + 2:
            return None
        arguments.append(data[start : start + length])
        at = start + length + 2
    return arguments, at


def _number(digits: bytes) -> int:
    try:
        number = int(digits)
    except ValueError:
        raise ProtocolError(f"not a length: {digits!r}") from None
    if not 0 <= number <= MAX_COMMAND:
        raise ProtocolError(f"a length out of range: {number}")
    return number


class _Client(Protocol):
    """One client's connection: each command answered as the table says."""

    def __init__(self, server: ScriptedRedis) -> None:
        self.server = server
        self.buffer = b""
        self.ended: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.server._opened(self)

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while self.buffer and self.transport is not None:
            try:
                read = read_command(self.buffer)
            except ProtocolError:
                self.transport.write(PROTOCOL_ERROR)
                self.transport.loseConnection()
                return
            if read is None:
                return
            command, used = read
            self.buffer = self.buffer[used:]
            if command:
                self.transport.write(self.server._answer(command))

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.server.clients.remove(self)
        self.ended.callback(None)


class ScriptedRedis:
    """A server on 127.0.0.1 that answers Redis's commands with the bytes a test sets."""

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        #: A command's name (upper case) to the raw bytes it is answered with.
        self.answers: dict[str, bytes] = {}
        #: Every command received, its arguments as sent, in order.
        self.commands: list[list[bytes]] = []
        self.clients: list[_Client] = []
        self._port: IListeningPort | None = None
        self._waiting: list[Deferred[None]] = []

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, once listening."""
        assert self._port is not None, "listen() first"
        return f"redis://127.0.0.1:{self._port.getHost().port}/0"  # type: ignore[attr-defined]

    def names(self) -> list[str]:
        """The names of the commands received, in order."""
        return [command[0].decode("ascii", "replace").upper() for command in self.commands]

    async def listen(self) -> None:
        endpoint = TCP4ServerEndpoint(self.reactor, 0, interface="127.0.0.1")
        self._port = await endpoint.listen(Factory.forProtocol(lambda: _Client(self)))

    def connected(self) -> Deferred[None]:
        """Fires when a client next connects."""
        waiting: Deferred[None] = Deferred()
        self._waiting.append(waiting)
        return waiting

    async def stop(self) -> None:
        """Stop listening and close every client's connection."""
        port, self._port = self._port, None
        if port is not None:
            await maybeDeferred(port.stopListening)
        clients = list(self.clients)
        for client in clients:
            client.transport.abortConnection()  # type: ignore[union-attr]
        for client in clients:
            await client.ended

    def _opened(self, client: _Client) -> None:
        self.clients.append(client)
        waiting, self._waiting = self._waiting, []
        for each in waiting:
            each.callback(None)

    def _answer(self, command: list[bytes]) -> bytes:
        self.commands.append(command)
        return self.answers.get(command[0].decode("ascii", "replace").upper(), OK)
