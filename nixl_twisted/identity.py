"""The proxy's identity, recorded by users as evidence of what produced a result.

These values are byte-stable: a change to the prefill lowering is a new
``VERSION``, never a silent edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

ID: Final = "inferlab-vllm-nixl-proxy"
VERSION: Final = 4


@dataclass(frozen=True)
class ProxyMeta:
    """The identity pair, as the reference proxy exports it."""

    id: str
    version: int


def meta() -> ProxyMeta:
    """Return this proxy's identity."""
    return ProxyMeta(id=ID, version=VERSION)
