"""Decode recomputing P/D prompts: vLLM's counters read, and a window of them judged."""

from __future__ import annotations

from nixl_twisted.backends.recompute import (
    LEAST_TOKENS,
    WINDOW,
    Sample,
    Share,
    Watch,
    likely_causes,
    share_between,
    transfer_counters,
)

#: Lines of real vLLM 0.32's /metrics (decode d1 on this machine), a histogram among them.
REAL = """\
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 6528.0
vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 3.0
vllm:nixl_num_failed_notifications_total{engine="0",model_name="tiny"} 0.0
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="tiny"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 8.290233e+06
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} 7e+06
vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 1.121977e+06
vllm:prompt_tokens_by_source_total{engine="1",model_name="tiny",source="local_compute"} 5.0
"""


def test_the_sources_and_failures_are_read_and_summed_over_engines() -> None:
    assert transfer_counters(REAL) == {
        "local_compute": 5.0,
        "local_cache_hit": 7000000.0,
        "external_kv_transfer": 1121977.0,
        "failed_transfers": 3.0,
        "expired_leases": 1.0,
    }
    assert transfer_counters("garbage\nvllm:prompt_tokens_by_source_total{x} y\n") == {}


def sample(at: float, local: float, pulled: float, alone: float = 0.0, **more: float) -> Sample:
    return Sample(at, {"local_compute": local, "external_kv_transfer": pulled, **more}, alone)


def test_the_share_is_local_compute_over_every_prompt_token_less_decode_only() -> None:
    share = share_between(sample(0, 100, 1000, 50), sample(5, 700, 1400, 350, failed_transfers=2))
    assert share == Share(recomputed=300, handed=700, failures={"failed_transfers": 2})
    assert round(share.ratio, 3) == 0.429
    # Decode-only prompts (computed there on purpose) alone: nothing recomputed.
    alone = share_between(sample(0, 0, 0, 0), sample(5, 4000, 0, 4000))
    assert alone is not None and alone.ratio == 0.0
    assert share_between(sample(0, 500, 0), sample(5, 10, 0)) is None  # a restart


def test_an_episode_begins_once_past_half_and_enough_tokens_then_ends_below_a_tenth() -> None:
    watch = Watch()
    assert watch.add(sample(0, 0, 0)) is None
    assert watch.add(sample(5, LEAST_TOKENS - 1, 0)) is None  # too few tokens to say
    assert watch.add(sample(10, 2 * LEAST_TOKENS, 0)) == "began"
    assert watch.add(sample(15, 3 * LEAST_TOKENS, 0)) is None  # one line per episode
    assert watch.episodes == 1 and watch.episode
    # The handoff works again: once the recomputed tokens leave the window, it ends.
    later = 15 + WINDOW + 1
    assert watch.add(sample(later, 3 * LEAST_TOKENS, 0)) is None  # nothing handed: unknown
    assert watch.add(sample(later + 5, 3 * LEAST_TOKENS, 20 * LEAST_TOKENS)) == "ended"
    assert watch.add(sample(later + 10, 40 * LEAST_TOKENS, 20 * LEAST_TOKENS)) == "began"
    assert watch.episodes == 2


def test_the_causes_put_what_the_counters_show_first() -> None:
    quiet = likely_causes({}, [])
    assert quiet.startswith("a NIXL handshake that fails")
    said = likely_causes(
        {"failed_transfers": 4},
        [
            ("http://p1", Share(0, 0, {"failed_transfers": 3, "expired_leases": 2})),
            ("http://p2", Share(0, 0, {})),
        ],
    )
    assert said.startswith(
        "KV leases that expired on prefill before decode pulled them (http://p1 2"
    )
    assert "NIXL transfers or handshakes that failed (decode 4, http://p1 3)" in said
    assert "http://p2" not in said
