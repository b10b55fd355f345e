"""``Happened``: something that happens once, and a Deferred for whoever waits on it."""

from __future__ import annotations

from twisted.internet.defer import Deferred


class Happened:
    """Fires every ``wait()`` Deferred when it happens, and later ones at once."""

    def __init__(self) -> None:
        self.happened = False
        self._waiting: list[Deferred[None]] = []

    def wait(self) -> Deferred[None]:
        waiting: Deferred[None] = Deferred()
        if self.happened:
            waiting.callback(None)
        else:
            self._waiting.append(waiting)
        return waiting

    def fire(self) -> None:
        if self.happened:
            return
        self.happened = True
        waiting, self._waiting = self._waiting, []
        for each in waiting:
            each.callback(None)
