"""Under ``--workers`` the status page's charts sum every worker's counters, read from the
multiprocess directory as ``/metrics`` reads it (``ProxyMetrics.sampled``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nixl_twisted.observe.history import sample_of
from nixl_twisted.observe.metrics import METRICS_DIR_ENV, ProxyMetrics
from tests.process.support import installed_env

#: One worker's requests: its metrics written to the shared directory, as a worker's are.
WORKER = """
from nixl_twisted.observe.metrics import ProxyMetrics
import os, sys
metrics = ProxyMetrics(shared_dir=os.environ["{env}"])
metrics.requests.labels("/v1/chat/completions", "200", "fake-model").inc(int(sys.argv[1]))
metrics.requests.labels("/healthcheck", "200", "").inc(100)
metrics.refused.labels("queue_full").inc()
"""


def test_the_charts_sum_what_every_worker_counted(tmp_path: Path) -> None:
    for requests in (3, 4):  # two processes, two pids: two workers' files
        subprocess.run(
            [sys.executable, "-c", WORKER.format(env=METRICS_DIR_ENV), str(requests)],
            env=installed_env({METRICS_DIR_ENV: str(tmp_path)}),
            check=True,
            timeout=60,
        )
    assert len(list(tmp_path.glob("counter_*.db"))) == 2
    sample = sample_of(ProxyMetrics(shared_dir=str(tmp_path)).sampled(), 0.0)
    assert sample.requests == 7.0  # (the proxy's own routes are not charted)
    assert sample.refused == {"queue_full": 2.0}
