"""A fake vLLM and a proxy harness for trial tests: yours and ours.

- :class:`FakeVLLM` plays prefill and decode as NIXL-enabled vLLM does
  (``fake``), sharing a :class:`TransferLedger` (``ledger``; a
  :class:`SharedLedger` across processes), answering in OpenAI's shapes
  (``answers``), failing as scripted (``behaviours``), or every request
  of one instance as its :class:`Fault` says (``faults``);
- :class:`KvPublisher` (``kv_publisher``) publishes a fake's KV cache events
  on ZeroMQ as vLLM does (``FakeVLLM(kv_events=True)``), replays included;
- :func:`start_cluster` (``cluster``) starts N fake prefills and M fake
  decodes sharing one ledger;
- :func:`start_pair`, :func:`start_proxy` and :func:`run_proxy`
  (``harness``) put a real proxy before fakes on loopback, and
  :class:`InMemoryProxy` (``memory``) the same proxy wholly in memory;
- :class:`FakeDns` (``dns``) answers A, AAAA and SRV queries on loopback,
  its records changed while it runs;
- :class:`FakeKubernetes` (``kubernetes``) lists and watches pods as the
  API server does, changed by tests while it runs;
- :class:`FakeCollector` (``collector``) receives OTLP/HTTP trace exports
  and decodes their spans;
- :class:`Twistd` and :func:`spawn_twistd` (``process``) run a real
  ``twistd nixlproxy`` and learn where it listens;
- ``redis.RedisServer`` runs a real ``redis-server`` on loopback (for
  ``--limits-redis``), ready when it says so, and ``resp.ScriptedRedis``
  speaks Redis's protocol as a test scripts it (garbage and wrong shapes);
- ``dnsmasq.Dnsmasq`` runs a real ``dnsmasq`` on loopback, its names from a
  hosts file and no upstream (for DNS discovery), ready when it says so.

Serve fakes from a shell with ``python -m nixl_twisted.testing --prefills N
--decodes M`` (``--help`` for the rest).
"""

from nixl_twisted.testing.behaviours import Behaviour, ErrorAnswer, RawAnswer
from nixl_twisted.testing.cluster import FakeCluster, start_cluster
from nixl_twisted.testing.collector import FakeCollector, ReceivedSpan
from nixl_twisted.testing.dns import FakeDns
from nixl_twisted.testing.fake import FakeVLLM
from nixl_twisted.testing.faults import Fault
from nixl_twisted.testing.harness import (
    FakePair,
    RunningProxy,
    run_proxy,
    start_pair,
    start_proxy,
)
from nixl_twisted.testing.kubernetes import FakeKubernetes
from nixl_twisted.testing.kv_publisher import KvPublisher
from nixl_twisted.testing.ledger import SharedLedger, TransferLedger
from nixl_twisted.testing.memory import InMemoryClient, InMemoryProxy
from nixl_twisted.testing.process import Twistd, TwistdProtocol, spawn_twistd
from nixl_twisted.testing.received import ReceivedRequest
from nixl_twisted.testing.site import FakeSite

__all__ = [
    "Behaviour",
    "ErrorAnswer",
    "FakeCluster",
    "FakeCollector",
    "FakeDns",
    "FakeKubernetes",
    "FakePair",
    "FakeSite",
    "FakeVLLM",
    "Fault",
    "InMemoryClient",
    "InMemoryProxy",
    "KvPublisher",
    "RawAnswer",
    "ReceivedRequest",
    "ReceivedSpan",
    "RunningProxy",
    "SharedLedger",
    "TransferLedger",
    "Twistd",
    "TwistdProtocol",
    "run_proxy",
    "spawn_twistd",
    "start_cluster",
    "start_pair",
    "start_proxy",
]
