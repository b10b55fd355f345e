"""``BackendsView``: the backends as ``/healthcheck`` and the admin API show them.

Each instance as its pool sees it, with what its KV events say, and
discovery's sources (``discovery.report``): read from the parts that own
them when asked, never copied into another's attributes.
"""

from __future__ import annotations

from typing import Any

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.service import BackendService
from nixl_twisted.discovery.report import Reported
from nixl_twisted.observe.scrape_metrics import KvStatus


class BackendsView:
    """The pools, what the KV events say of each instance, and discovery's report."""

    def __init__(self, backends: BackendService, kv: KvStatus, report: Reported) -> None:
        self.backends = backends
        self.kv = kv
        self.report = report

    def status(self, instance: Instance) -> dict[str, Any]:
        """What /healthcheck and the admin listing say of an instance, its KV events included."""
        said = instance.status()
        pool = self.backends.pool(instance.role)
        said["ejected"] = pool is not None and pool.ejected(instance)
        said["ejections"] = instance.ejected_total
        said["kv_events"] = self.kv.status(instance.role, instance.url)
        return said

    def instances(self) -> dict[str, list[dict[str, Any]]]:
        """Every instance of each pool, by the pool's role."""
        return {
            pool.role: [self.status(instance) for instance in pool.instances]
            for pool in self.backends.pools()
        }
