"""The metrics of ``--replicas-redis``: what this replica holds, what it sees of the fleet,
and how Redis answers (``fleet.replicas``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Seconds a Redis script takes, from a loopback round trip to the budget and past it.
REDIS_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class ReplicaMetrics:
    """One replica's part of the fleet, as Prometheus reads it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.fallback = Gauge(
            "nixlproxy_replicas_fallback",
            "1 while --replicas-redis does not answer and this replica holds the caps to its "
            "static share and queues alone; 0 while the fleet's state is shared.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.fallbacks = Counter(
            "nixlproxy_replicas_fallbacks",
            "Times this replica lost --replicas-redis and went on alone, by why.",
            ["reason"],
            registry=r,
        )
        self.seen = Gauge(
            "nixlproxy_replicas_seen",
            "Replicas whose heartbeat is live in --replicas-redis, as this replica last read.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.slots_held = Gauge(
            "nixlproxy_replicas_slots_held",
            "Slots (legs in flight under a cap) this replica holds in --replicas-redis, by pool.",
            ["pool"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.fleet_slots = Gauge(
            "nixlproxy_replicas_fleet_slots",
            "Legs in flight under a cap over every replica, by pool, as this replica last saw.",
            ["pool"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.fleet_waiting = Gauge(
            "nixlproxy_replicas_fleet_waiting",
            "Requests waiting for a slot over every replica, as this replica last read "
            "(at each of its placements and each heartbeat).",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.fleet_cap = Gauge(
            "nixlproxy_replicas_fleet_cap",
            "The cap the fleet holds each instance to: the lowest any live replica gives it "
            "(0: none), as this replica last read.",
            ["pool", "instance"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.cap_mismatch = Gauge(
            "nixlproxy_replicas_cap_mismatch",
            "1 while the live replicas give an instance different caps (the fleet holds the "
            "lowest), else 0.",
            ["pool", "instance"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.admin_changes = Counter(
            "nixlproxy_replicas_admin_changes",
            "Admin API changes (add, drain, remove) through --replicas-redis, by outcome: told "
            "(made here, written for the fleet), applied (another replica's, made here), "
            "unknown (no such instance here), refused (it would empty a pool), not_allowed "
            "(outside --allowed-backends here), malformed (a line that does not parse).",
            ["outcome"],
            registry=r,
        )
        self.leases_expired = Counter(
            "nixlproxy_replicas_leases_expired",
            "Slots given back because the replica holding them stopped its heartbeat "
            "(counted by the replica that noticed).",
            registry=r,
        )
        self.told = Counter(
            "nixlproxy_replicas_told",
            "What this replica told the others through --replicas-redis, by kind: sent "
            "(a cache-aware choice), predicted (a kv-aware prediction of new blocks), "
            "response (a stored response's decode instance).",
            ["kind"],
            registry=r,
        )
        self.heard = Counter(
            "nixlproxy_replicas_heard",
            "Routing choices of the other replicas applied here, by kind: sent, predicted.",
            ["kind"],
            registry=r,
        )
        self.redis_seconds = Histogram(
            "nixlproxy_replicas_redis_seconds",
            "Round trips to --replicas-redis, by script.",
            ["script"],
            registry=r,
            buckets=REDIS_BUCKETS,
        )
