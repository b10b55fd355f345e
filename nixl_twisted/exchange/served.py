"""``Served``: one completion as each of its legs sees it, besides its ``Completion``.

The exchange (``two_legs``) makes it once its slots are placed, and hands
the same value to its prefill leg and its decode leg: nothing one leg
learns reaches the other but through what it returns.
"""

from __future__ import annotations

from typing import NamedTuple

from twisted.web.http_headers import Headers

from nixl_twisted.config import ProxyConfig
from nixl_twisted.exchange.phased import Phases
from nixl_twisted.exchange.request import ExchangeRequest
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.observe.spans import RequestTrace


class Served(NamedTuple):
    """Whose the legs are and what they are sent with, the same for both (immutable, and
    made per completion in two calls: a tuple, not a frozen dataclass's setattr per field)."""

    #: The client's request (or a batch's part): what decode's answer is relayed to.
    request: ExchangeRequest
    #: The path and query after an instance's base URL, and the headers each leg sends.
    target: str
    headers: Headers
    #: The configuration in effect when the completion started (a reload changes the next).
    config: ProxyConfig
    trace: RequestTrace
    record: AccessRecord
    #: Where the completion stands, what it waits for, what its client leaving does.
    phases: Phases
    #: Its legs go only to instances with room (some instance has a cap).
    room: bool
