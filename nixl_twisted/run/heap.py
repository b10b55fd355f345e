"""The heap the proxy starts with, set aside from the garbage collector once it serves.

CPython's full collection walks every tracked object, and a started proxy
holds some 70,000 of them (its modules, classes, functions and settings)
that live as long as the process. Under 64 paced streams a full collection
held the reactor's only thread for 51-104 ms of CPU every few seconds, and
every request in flight waited; with them frozen (``gc.freeze``, moved to a
generation the collector never walks) it takes 14-16 ms
(docs/performance.md). What requests make is collected as usual: only the
start's heap is frozen.
"""

from __future__ import annotations

import gc


def settle() -> int:
    """Collect what startup left behind, then freeze the rest: how many objects it froze.

    Collected first, so that no garbage of startup is kept for the
    process's life; called once, when the proxy first says it serves.
    """
    gc.collect()
    before = gc.get_freeze_count()
    gc.freeze()
    return gc.get_freeze_count() - before
