"""A completion's phases, and what ends each of them: the one table ``RULES``.

Mirrored in ``docs/failures.md`` and checked against it by the tests. What
a client disconnect does in each phase:

- ``queued`` (waiting for its slots, instances at their caps): taken out of
  the queue; nothing was sent;
- ``prefill``: the prefill request is cancelled (its connection closed, so
  vLLM frees what it computed) and no decode is sent;
- ``handoff`` (prefill answered, decode not yet): prefill holds KV blocks
  that only decode can free, so the decode leg is still sent and abandoned
  as soon as it answers; decode then tells prefill to free them;
- ``decode`` (a decode-only request, no prefill leg: ``routing.md``): no
  other instance holds blocks for it, so the decode request is cancelled;
- ``relay``: the decode connection is closed at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class Phase(enum.Enum):
    #: Waiting in the proxy's queue for its slots (instances at their caps): nothing sent.
    QUEUED = "queued"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DECODE = "decode"
    RELAY = "relay"


class OnClientLeft(enum.Enum):
    #: Close the leg's connection now: vLLM aborts the request and frees its blocks.
    CANCEL = "cancel"
    #: Send decode anyway and drop its answer: only decode can free prefill's blocks.
    FINISH_THEN_ABANDON = "finish_then_abandon"


@dataclass(frozen=True)
class Rule:
    on_client_left: OnClientLeft
    #: The settings whose timers run in this phase.
    timers: tuple[str, ...]


RULES: Final[dict[Phase, Rule]] = {
    Phase.QUEUED: Rule(OnClientLeft.CANCEL, ("queue-timeout",)),
    Phase.PREFILL: Rule(OnClientLeft.CANCEL, ("prefill-timeout",)),
    Phase.HANDOFF: Rule(OnClientLeft.FINISH_THEN_ABANDON, ("prefill-timeout", "decode-timeout")),
    Phase.DECODE: Rule(OnClientLeft.CANCEL, ("decode-timeout",)),
    Phase.RELAY: Rule(OnClientLeft.CANCEL, ("stream-idle-timeout",)),
}
