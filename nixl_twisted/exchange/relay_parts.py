"""What a relay is composed of: the idle timer's ``Silence``, the ``Passes`` that may change
a body on its way to the client, and what has ``Seen`` it, each told apart so that a relay
takes three parts, not every hook as a parameter of its own (``relay.relay``).
"""

from __future__ import annotations

import typing
from collections.abc import Callable

from twisted.internet.interfaces import IReactorTime

from nixl_twisted.protocol.usage import UsageChunkHidden


class Filter(typing.Protocol):
    """What stands between decode's body and the client when the answer may move to another
    instance (``protocol.transcript``): it passes what the client may have now, keeps what
    a continuation needs, and catches an in-band error event instead of passing it."""

    #: The error event caught, and what came after it (None: none).
    error: bytes | None
    #: Nothing more to look at: the rest passes as it comes.
    done: bool

    def __call__(self, data: bytes) -> bytes: ...

    def rest(self) -> bytes:
        """What it held when the body ended whole."""


class Silence:
    """How long a body may go silent (``seconds``; None: forever), by ``clock``."""

    __slots__ = ("clock", "seconds")

    def __init__(self, clock: IReactorTime, seconds: float | None) -> None:
        self.clock = clock
        self.seconds = seconds


class Taker(typing.Protocol):
    """What decode's body passes first (``protocol.decode_handle.HandleTaker``): it takes
    out what no client may have (decode's handle), and may hold a whole answer to."""

    #: Nothing held, and a stream's whole event that does not name the handle passes as it
    #: is: the relay need not call it.
    idle: bool

    def __call__(self, data: bytes) -> bytes: ...

    def rest(self) -> bytes:
        """What it held when the body ended whole."""


class Passes:
    """What stands between a body and the client, in order: ``taken``, what no client may
    have taken out (None: nothing to take), ``filtered``, what the client may have of it
    now (an answer that may move; None: all of it), then ``hidden``, which takes out the
    chunk the proxy asked for itself (the usage chunk)."""

    __slots__ = ("filtered", "hidden", "taken")

    def __init__(
        self,
        filtered: Filter | None = None,
        hidden: UsageChunkHidden | None = None,
        taken: Taker | None = None,
    ) -> None:
        self.filtered = filtered
        self.hidden = hidden
        self.taken = taken


class Seen:
    """What looks at a body as it passes and never changes it: ``first_byte`` is told its
    first chunk came; ``watch`` is shown each chunk until it says it has seen enough;
    ``tail`` is given the last two chunks however the body ended (where vLLM puts
    ``usage``); ``terminal``: an event stream's last events, one of which must come
    (``protocol.events.terminal``), else the relay fails with ``StreamCutShort``."""

    __slots__ = ("first_byte", "tail", "terminal", "watch")

    def __init__(
        self,
        first_byte: Callable[[], None] | None = None,
        watch: Callable[[bytes], bool] | None = None,
        tail: Callable[[bytes], None] | None = None,
        terminal: tuple[bytes, ...] = (),
    ) -> None:
        self.first_byte = first_byte
        self.watch = watch
        self.tail = tail
        self.terminal = terminal


NO_PASSES = Passes()
NO_SEEN = Seen()
