"""A replica's static share of a limit the replicas hold together, while Redis is away.

Not ``backends.capacity.share``: that splits a cap among a process's own
``--workers`` exactly, by worker index, known at start; this one divides
among the replicas last seen alive, at least one each, so that no replica
is left with nothing when the count is higher than the limit.
"""

from __future__ import annotations


def replica_share(whole: int, replicas: int) -> int:
    """This replica's part of ``whole`` among ``replicas``: at least 1."""
    return max(1, whole // replicas)
