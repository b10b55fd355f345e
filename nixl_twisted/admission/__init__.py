"""Admission: whether and when a request may take capacity, alone or shared.

The step every route passes (``gate``: the tenant admitted by ``Tenancy``,
then ``--max-in-flight``), each tenant's limits (``limits``: in this process;
``windows``: requests and tokens per minute for every process through
``--limits-redis``; requests in flight held here or, ``shared_tenants``, over
every replica through ``--replicas-redis``, behind ``tenant_places``), and the
fair queue in front of capped instances (``slots``, prefill let run ahead of
decode by ``run_ahead``, the fleet's count of it ``fleet_ahead``: this process's
``fair_queue``, or every replica's ``shared_queue`` with ``shared_slots``, the
fleet's legs per instance, behind ``switched_queue``, which goes alone while
Redis does not answer), its first-token deadlines (``deadlines``: early
refusal, the earliest deadline first within a tenant) from the rates the
legs measured (``predictor``). The rest of the house uses what ``__all__`` names; the
scripts these run (``lease_scripts``, ``window_scripts``, and
``fleet.queue_scripts``) are called from inside this room only.
"""

from nixl_twisted.admission.fair_queue import FairQueue
from nixl_twisted.admission.fleet_ahead import FleetAhead
from nixl_twisted.admission.gate import Admission, Counted
from nixl_twisted.admission.limits import TenantLimits, read_secret
from nixl_twisted.admission.outcomes import AT_ONCE, QueueOutcome
from nixl_twisted.admission.predictor import Rates
from nixl_twisted.admission.queue import SlotQueue
from nixl_twisted.admission.run_ahead import RunAhead
from nixl_twisted.admission.share import replica_share
from nixl_twisted.admission.shared_queue import SharedQueue
from nixl_twisted.admission.shared_slots import SharedSlots
from nixl_twisted.admission.shared_tenants import SharedTenants
from nixl_twisted.admission.slots import Slots
from nixl_twisted.admission.switched_queue import SwitchedQueue
from nixl_twisted.admission.tenancy import KeyTenants, Tenancy
from nixl_twisted.admission.tenant_places import LocalTenants, TenantPlaces
from nixl_twisted.admission.waiting import Claim, Pool, Waiting
from nixl_twisted.admission.windows import SharedWindows

__all__ = [
    "AT_ONCE",
    "Admission",
    "Claim",
    "Counted",
    "FairQueue",
    "FleetAhead",
    "KeyTenants",
    "LocalTenants",
    "Pool",
    "QueueOutcome",
    "Rates",
    "RunAhead",
    "SharedQueue",
    "SharedSlots",
    "SharedTenants",
    "SharedWindows",
    "SlotQueue",
    "Slots",
    "SwitchedQueue",
    "Tenancy",
    "TenantLimits",
    "TenantPlaces",
    "Waiting",
    "read_secret",
    "replica_share",
]
