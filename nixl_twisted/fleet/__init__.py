"""Several processes acting as one proxy: what they share through ``--replicas-redis``.

A replica is one process that serves requests (a ``twistd nixlproxy``, or
one of its ``--workers``). With ``--replicas-redis`` every replica of one
proxy keeps there, in one Redis, what must hold for all of them: each
instance's slots (its cap counted over every replica), the fair queue's
order, tenants' requests in flight, each tied to its replica's heartbeat
(``replicas``), so that a replica that dies gives back what it held; the
routing view (``routes``). The scripts (``queue_scripts``, ``heartbeat`` and
the others beside what they serve; ``scripts`` names the keys) are the only
writers; ``link`` is the connection, made again when Redis refuses it. What
admission does with these (the fleet's queue, its slots, tenants' places) is
``admission``'s.
"""
