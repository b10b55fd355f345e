"""``StreamReader``: every entry of the routing view's streams, from their start, then live.

One ``XREAD BLOCK`` at a time, on a connection of its own (a blocking read
would hold up the scripts behind it), from the last entry read of each
stream: the first reads take what the streams hold (a replica that starts
takes the fleet's view instead of starting cold), the next ones return as
soon as another replica adds an entry (within a millisecond on a LAN). A
read that fails (Redis away, the connection lost) is made again ``RETRY``
s later from where it stopped, so a replica that lost its connection for
a while catches up on what the streams still hold.

Each entry is told with its age (Redis's clock, ``TIME``, less the time
in its id), so that a prediction read late counts only for what is left
of its life.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.fleet.link import RETRY, SILENCE, RedisLink
from nixl_twisted.fleet.replies import text
from nixl_twisted.happened import Happened

log = Logger()

#: Entries asked for per stream and read, and how long a read waits for one (ms).
COUNT = 512
BLOCK_MS = 500


class StreamReader:
    """Reads ``streams`` (full key names) and tells ``heard(stream, text, age)`` each entry."""

    def __init__(
        self,
        url: str,
        reactor: Any,
        streams: Sequence[str],
        heard: Callable[[str, str, float], object],
    ) -> None:
        self.reactor = reactor
        self.heard = heard
        self.link = RedisLink(url, reactor, lambda why: None)  # (Replicas says Redis is away)
        #: The id of the last entry read, per stream ("0-0": from the start).
        self.last = {stream: "0-0" for stream in streams}
        #: Redis's clock less this process's, in ms (None: to be asked at the next read).
        self._offset_ms: float | None = None
        self._reading = False
        self._retry: IDelayedCall | None = None
        self._asked: Deferred[Any] | None = None
        self._caught_up = Happened()

    def start(self) -> None:
        self._reading = True
        self.link.start()
        self._read()

    def stop(self) -> Any:
        self._reading = False
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        if self._asked is not None:
            self._asked.cancel()  # (waiting for a connection that will not come)
        return self.link.stop()

    def caught_up(self) -> Deferred[None]:
        """Fires once a read has taken everything the streams held (for tests)."""
        return self._caught_up.wait()

    def _read(self) -> None:
        self._retry = None
        if not self._reading:
            return
        if self._offset_ms is None:
            asked = self._asked = self.link.command("TIME")
            asked.addTimeout(SILENCE, self.reactor)
            asked.addCallback(self._timed).addErrback(self._failed)
            return
        keys = list(self.last)
        asked = self._asked = self.link.command(
            "XREAD", "COUNT", COUNT, "BLOCK", BLOCK_MS, "STREAMS", *keys, *self.last.values()
        )
        asked.addTimeout(BLOCK_MS / 1000 + SILENCE, self.reactor)
        asked.addCallback(self._got).addErrback(self._failed)

    def _timed(self, said: Any) -> None:
        self._asked = None
        seconds, micros = (int(text(part)) for part in said)
        self._offset_ms = seconds * 1000 + micros / 1000 - self.reactor.seconds() * 1000
        self._read()

    def _got(self, reply: Any) -> None:
        self._asked = None
        full = False
        for stream, entries in reply or ():
            name = text(stream)
            full = full or len(entries) >= COUNT
            for entry_id, fields in entries:
                said = text(entry_id)
                self.last[name] = said
                self._tell(name, said, fields)
        if not full:
            self._caught_up.fire()
        self._read()

    def _tell(self, stream: str, entry_id: str, fields: Any) -> None:
        values = [text(v) for v in fields] if isinstance(fields, list) else []
        message = dict(zip(values[::2], values[1::2], strict=False)).get("m")
        if message is None:
            return
        now_ms = self.reactor.seconds() * 1000 + (self._offset_ms or 0.0)
        age = max(0.0, (now_ms - int(entry_id.partition("-")[0])) / 1000)
        try:
            self.heard(stream, message, age)
        except Exception:
            log.failure("replicas: an entry of {stream} was not applied", stream=stream)

    def _failed(self, failure: Failure) -> None:
        """Redis away, the connection lost, or an answer that is not XREAD's: again later."""
        self._asked = None
        self._offset_ms = None
        if self._reading:
            self._retry = self.reactor.callLater(RETRY, self._read)
