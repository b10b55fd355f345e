"""The heap the proxy starts with, set aside from the garbage collector once it serves.

CPython's full collection walks every tracked object, and a started proxy
holds some 70,000 of them (its modules, classes, functions and settings)
that live as long as the process. Walking them took 20-60 ms of the
reactor's only thread every few seconds under streaming load, and every
request in flight waited for it: that was most of the first-token p99
(docs/performance.md). ``gc.freeze`` moves what exists then to a
generation the collector never walks; what requests make later is
collected as before.
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
