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


class Lane(str, Enum):
    """What a request waits for: its first slot (a prefill slot, or both of a one-step
    placement), or, prefilled, its decode slot (``ready``: let go before any new request
    of its model, never refused for room, never timed out)."""

    WAIT = "wait"
    READY = "ready"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Claim:
    """Who waits: its tenant (None: none) and the tenant's rule (its weight and priority),
    its model's instances, what it waits for (``Lane``) and its first-token target (None:
    none, ``admission.deadlines``)."""

    tenant: str | None = None
    rule: TenantRule = NO_RULE
    model: str | None = None
    lane: Lane = Lane.WAIT
    target: Target | None = None
    #: Its prompt's tokens, estimated from its body (None: not known): its prefill's time
    #: is predicted from them.
    prompt: int | None = None

    @classmethod
    def of(cls, completion: Completion) -> Claim:
        """A completion's place in the queue, as its tenant's rule gives it."""
        claim = cls(completion.tenant, completion.rule, completion.served)
        return replace(claim, target=completion.ttft_target, prompt=completion.estimate)

    def ready(self) -> Claim:
        """The same request, prefilled: it waits for its decode slot now (its target orders
        it there, earliest deadline first, but never refuses it: its prefill is done)."""
        return replace(self, lane=Lane.READY)

    @property
    def is_ready(self) -> bool:
        return self.lane is Lane.READY

    @property
    def weight(self) -> float:
        return self.rule.weight

    @property
    def priority(self) -> int:
        return self.rule.priority or 0

    @property
    def sheddable(self) -> bool:
        return self.priority < 0 and not self.is_ready


#: What the ready lane's key in Redis adds to its model's: a tab, which no model's own key
#: holds (``shared_queue`` keys a name with one as those that name none).
READY_SUFFIX = "\tready"


def ready_key(model: str) -> str:
    """The key of ``model``'s ready lane in the fleet's queue (``queue_scripts.PLACE``'s model)."""
    return model + READY_SUFFIX


class Pool(str, Enum):
    """The pool a placement found full, so that its request waits (the ``pool`` label of
    the queue's gauges and ``PLACE``'s word for it: its value). A placement answers a plain
    ``str`` too (a test's): the queues read either."""

    DECODE = "decode"
    PREFILL = "prefill"

    def __str__(self) -> str:
        return self.value


class Held(Protocol):
    """What a placement holds: its decode slot (None: not yet, its prefill runs first), its
    prefill slot (None: none, or not yet)."""

    @property
    def decode(self) -> Lease | None: ...

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
