"""Under ``--workers`` each pool's saturation is the whole proxy's: each worker writes its
parts (its share of the caps, its legs, its queue) to the multiprocess directory, and the
ratio is worked out from their sums, not from any one worker's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from nixl_twisted.observe.metrics import METRICS_DIR_ENV, ProxyMetrics
from tests.process.support import installed_env

#: One worker: its share of a cap of 5 taken whole, ``argv[2]`` requests waiting, one refused.
WORKER = """
import os, sys
from twisted.internet.task import Clock
from nixl_twisted.backends.capacity import Caps
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.observe.metrics import ProxyMetrics
decode = BackendPool("decode", ["http://d1:1"], Clock())
decode.use_caps(Caps(default=5, worker=int(sys.argv[1]), workers=2))
for _ in range(decode.instances[0].slots):
    decode.lease(decode.instances[0])
queued = [("decode", "", "")] * int(sys.argv[2])
metrics = ProxyMetrics([decode], shared_dir=os.environ["{env}"])
metrics.saturation.reads(lambda: queued)
metrics.saturation.sample()
metrics.saturation.told("queue_full", None)
"""


def test_the_saturation_is_worked_out_from_every_workers_parts(tmp_path: Path) -> None:
    for worker, waiting in ((0, 2), (1, 1)):
        subprocess.run(
            [sys.executable, "-c", WORKER.format(env=METRICS_DIR_ENV), str(worker), str(waiting)],
            env=installed_env({METRICS_DIR_ENV: str(tmp_path)}),
            check=True,
            timeout=60,
        )
    assert len(list(tmp_path.glob("gauge_livesum_*.db"))) == 2
    text = ProxyMetrics(shared_dir=str(tmp_path)).exposition().decode()
    said = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("nixlproxy_pool_") and sample.labels["pool"] == "decode"
    }
    assert said == {
        "nixlproxy_pool_slots_in_use": 5.0,  # (2 + 3: each worker's share, taken whole)
        "nixlproxy_pool_queued": 3.0,
        "nixlproxy_pool_slots": 5.0,
        "nixlproxy_pool_refused_total": 2.0,
        "nixlproxy_pool_saturation": (5 + 3) / 5,  # (no one worker's own ratio)
    }
