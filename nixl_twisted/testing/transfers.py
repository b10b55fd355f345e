"""``PromptSources``: where a fake's prompt tokens came from, as vLLM's ``/metrics`` counts them.

vLLM counts every prompt token by source: computed here (``local_compute``),
pulled from a prefill (``external_kv_transfer``) or found in its own prefix
cache (``local_cache_hit``); and its NIXL connector counts the transfers that
failed and (on prefill) the KV leases that expired. A decode told to recompute silently
(``FakeVLLM.recompute_silently``) counts its P/D legs' prompts as
``local_compute``, as vLLM does when the handoff fails on its side.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptSources:
    """The counters, moved by the fake as it serves, or by a test."""

    local_compute: int = 0
    external_kv_transfer: int = 0
    local_cache_hit: int = 0
    failed_transfers: int = 0
    expired_leases: int = 0

    def exposition(self, labels: str) -> str:
        """The counters as vLLM 0.32 names them, each with ``labels`` (``engine="0",...``)."""
        lines = [
            f'vllm:prompt_tokens_by_source_total{{{labels},source="{source}"}} '
            f"{float(getattr(self, source))}\n"
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        ]
        failures = {
            "vllm:nixl_num_failed_transfers_total": self.failed_transfers,
            "vllm:nixl_num_kv_expired_reqs_total": self.expired_leases,
        }
        lines += [f"{name}{{{labels}}} {float(value)}\n" for name, value in failures.items()]
        return "".join(lines)
