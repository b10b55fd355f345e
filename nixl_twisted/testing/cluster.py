"""``start_cluster``: N fake prefills and M fake decodes that share one ledger.

A decode redeems ``kv_transfer_params`` only from the ledger its prefill
wrote to, so instances that a proxy may pair in any way must share one:
in one process, as ``python -m nixl_twisted.testing --prefills N --decodes M``
serves them, or in a directory several such processes share (``--ledger``).
It imports the fake's modules only, never the proxy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred, gatherResults

from nixl_twisted.testing.fake import FakeVLLM
from nixl_twisted.testing.ledger import TransferLedger


@dataclass
class FakeCluster:
    """Fake prefill and decode instances sharing one ledger, each listening."""

    prefills: list[FakeVLLM]
    decodes: list[FakeVLLM]
    ledger: TransferLedger

    @property
    def instances(self) -> list[FakeVLLM]:
        return [*self.prefills, *self.decodes]

    def stop(self) -> Deferred[Any]:
        """Stop every instance (listening, and its open connections)."""
        return gatherResults([fake.stop() for fake in self.instances])


async def start_cluster(
    prefill_listen: Sequence[str],
    decode_listen: Sequence[str],
    reactor: Any = None,
    ledger: TransferLedger | None = None,
    **fake_options: Any,
) -> FakeCluster:
    """One fake prefill per endpoint of ``prefill_listen`` (``prefill-0``, ...)
    and one decode per endpoint of ``decode_listen`` (``decode-0``, ...), all
    sharing one ledger (``ledger``, else a new one in this process: a
    ``SharedLedger`` to share it with fakes in other processes);
    ``fake_options`` are ``FakeVLLM``'s (``tokens=4``).

    If one cannot listen, those already listening are stopped and the error raised.
    """
    ledger = ledger if ledger is not None else TransferLedger()
    cluster = FakeCluster(
        [
            FakeVLLM(name=f"prefill-{i}", ledger=ledger, **fake_options)
            for i in range(len(prefill_listen))
        ],
        [
            FakeVLLM(name=f"decode-{i}", ledger=ledger, **fake_options)
            for i in range(len(decode_listen))
        ],
        ledger,
    )
    endpoints = [*prefill_listen, *decode_listen]
    listening: list[FakeVLLM] = []
    try:
        for fake, endpoint in zip(cluster.instances, endpoints, strict=True):
            await fake.listen(endpoint, reactor)
            listening.append(fake)
    except BaseException:
        await gatherResults([fake.stop() for fake in listening])
        raise
    return cluster
