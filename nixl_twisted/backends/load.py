"""vLLM's own load, as its ``/metrics`` exposition says it: what the ``load`` policy reads.

The health checks scrape it (``BackendService``); the policy and the busy
rule read the result from each ``Instance.load``.
"""

from __future__ import annotations

from collections.abc import Callable

#: vLLM's gauges the ``load`` policy reads, summed over its engines (and their
#: name before vLLM 0.10, ``gpu_cache_usage_perc``).
_LOAD_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
}


def summed(exposition: str, key_of: Callable[[str, str], str | None]) -> dict[str, float]:
    """Samples of vLLM's ``/metrics`` text summed by ``key_of(name, labels)`` (None: skipped):
    over its engines, as vLLM gives one sample per engine."""
    sums: dict[str, float] = {}
    for line in exposition.splitlines():
        name, _, labels = line.partition("{")
        key = key_of(name.split(" ", 1)[0], labels)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        sums[key] = sums.get(key, 0.0) + value
    return sums


def vllm_load(exposition: str) -> dict[str, float]:
    """The running and waiting requests and the KV cache use from vLLM's ``/metrics`` text."""
    return summed(exposition, lambda name, _: _LOAD_GAUGES.get(name))
