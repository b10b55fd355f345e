"""Who waits for slots (``Claim``), one request waiting (``Waiting``), in this process's
queue or every replica's, what its placement holds (``Held``) or the pool it found full
(``Pool``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Generic, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from nixl_twisted.backends.pools import Lease
from nixl_twisted.config import NO_RULE, TenantRule
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.targets import Target


@dataclass(frozen=True)
class Claim:
    """Who waits: its tenant (None: none) and the tenant's rule (its weight and priority),
    and its model's instances; its first-token target (None: none, ``admission.deadlines``)."""

    tenant: str | None = None
    rule: TenantRule = NO_RULE
    model: str | None = None
    target: Target | None = None

    @classmethod
    def of(cls, completion: Completion) -> Claim:
        """A completion's place in the queue, as its tenant's rule gives it."""
        claim = cls(completion.tenant, completion.rule, completion.served)
        return replace(claim, target=completion.ttft_target)

    @property
    def weight(self) -> float:
        return self.rule.weight

    @property
    def priority(self) -> int:
        return self.rule.priority or 0

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


class Pool(str, Enum):
    """The pool a placement found full, so that its request waits (the ``pool`` label of
    the queue's gauges and ``PLACE``'s word for it: its value). A placement answers a plain
    ``str`` too (a test's): the queues read either."""

    DECODE = "decode"
    PREFILL = "prefill"

    def __str__(self) -> str:
        return self.value


class Held(Protocol):
    """What a placement holds: its decode slot, its prefill slot (None: none yet)."""

    @property
    def decode(self) -> Lease: ...

    @property
    def prefill(self) -> Lease | None: ...

    def release(self) -> None: ...


T = TypeVar("T")
H = TypeVar("H", bound=Held)


@dataclass(eq=False)
class Waiting(Generic[T]):
    """One request, from its arrival until it has its slots or is refused."""

    ticket: Claim
    place: Callable[[], T | Pool]
    arrived: float
    deferred: Deferred[T] = field(default_factory=Deferred)
    #: Its weighted-fair finish tag (SCFQ), in whichever queue holds it.
    finish: float = 0.0
    timer: IDelayedCall | None = None
    #: The pool it found full last time it was tried ("": none, it waits behind another).
    blocked: Pool | str = ""
    #: It has its slots, or was refused, or left the queue.
    done: bool = False
    #: Its place in the order requests came (ties between deadlines, ``deadlines``).
    order: int = 0
    # -- in every replica's queue (``shared_queue``) --
    #: The model whose queue in Redis it waits in: its own when an instance is known to
    #: serve it, else "" (with the requests that name none), so that a name a client
    #: chose never becomes a key.
    model: str = ""
    #: Its place in the queue in Redis ("": none yet).
    member: str = ""
    #: Its client left (while Redis was asked).
    gone: bool = False
    #: Where it waits while this replica is alone (``FairQueue``'s Deferred).
    inner: Deferred[T] | None = None
    #: At its latest start, still waiting: refused for its first-token target (``deadlines``).
    latest: IDelayedCall | None = None
