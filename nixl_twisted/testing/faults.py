"""``Fault``: what one fake instance does to every generation request, until told otherwise.

A scripted behaviour (``behaviours``) is one request's; a fault is the
instance's, as long as it lasts: a decode whose KV loads all fail, an
engine that hangs, one that answers 500 to everything. It is what a test (or
``python -m nixl_twisted.testing --fault decode-1=fail-kv``) sets on one
instance of a pool, to rehearse "one decode dies" while the others serve.
"""

from __future__ import annotations

from enum import Enum


class Fault(Enum):
    """How one instance fails every generation request (``FakeVLLM.fault``)."""

    #: Every decode leg's KV load fails: vLLM's 500 ``KV load failed``, counted in
    #: its NIXL failures (prefill legs and plain requests are served).
    FAIL_KV = "fail-kv"
    #: Every generation request is taken and never answered (its client may leave);
    #: ``GET /health`` still answers, as a process whose engine is stuck does.
    HANG = "hang"
    #: Every generation request is answered 500, vLLM's engine error.
    ERROR_500 = "500"


def fault_named(name: str) -> Fault:
    """The fault called ``name`` (``fail-kv``, ``hang``, ``500``); ``ValueError`` naming them."""
    try:
        return Fault(name)
    except ValueError:
        known = ", ".join(fault.value for fault in Fault)
        raise ValueError(f"no fault {name!r}: one of {known}") from None
