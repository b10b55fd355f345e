"""Multi-turn reuse: decode's handle on a finished conversation's KV, kept for its next turn.

``handles`` says what a handle is and which prompt may read it; ``kept``
keeps them (one process's, or the fleet's in Redis) and lets each be read
once. The exchange's side is ``exchange.reusing``; the handle is taken out
of decode's answer by ``protocol.decode_handle``.
"""

from nixl_twisted.reuse.handles import Handle, readable, scope_of
from nixl_twisted.reuse.kept import NOTHING, Found, HandleStore, SharedHandles

__all__ = ["NOTHING", "Found", "Handle", "HandleStore", "SharedHandles", "readable", "scope_of"]
