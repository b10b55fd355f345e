"""Decode recomputing the prompts of P/D legs itself: vLLM's own counters, judged over a window.

When the KV handoff fails on decode's side (an expired lease, a NIXL
handshake that fails, mismatched NIXL versions, params decode cannot use),
vLLM does not fail the request: decode computes the whole prompt itself,
and only its ``vllm:prompt_tokens_by_source_total{source="local_compute"}``
says so. The health loop scrapes every instance's ``/metrics``; here each
decode instance's samples over ``WINDOW`` seconds are judged: the share of
the prompt tokens of P/D legs it computed itself (``local_compute`` less the
decode-only prompts the proxy sent it on purpose, over every prompt token
less those). At ``RAISE_AT`` an episode begins (one warning line, with the
likely causes read from vLLM's NIXL failure counters of decode and of every
prefill instance); below ``CLEAR_BELOW`` it ends (one info line).
``docs/operations.md``, "Decode recomputing P/D prompts".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from twisted.logger import Logger

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.load import summed

log = Logger()

#: Seconds of samples judged together.
WINDOW = 60.0
#: The share of P/D prompt tokens decode computed itself at which an episode begins ...
RAISE_AT = 0.5
#: ... and below which it ends.
CLEAR_BELOW = 0.1
#: Prompt tokens in a window below which nothing is judged (a few short prompts say little).
LEAST_TOKENS = 1024

#: ``vllm:prompt_tokens_by_source_total``'s sources, summed over engines.
SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")
_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
#: vLLM's NIXL failure counters, by the name the warning gives them: transfers that
#: failed (handshakes and notifications included), and KV leases that expired before
#: decode pulled (counted on the prefill instance).
FAILURES = {
    "vllm:nixl_num_failed_transfers_total": "failed_transfers",
    "vllm:nixl_num_kv_expired_reqs_total": "expired_leases",
}


def transfer_counters(exposition: str) -> dict[str, float]:
    """The prompt tokens by source and the NIXL failures in vLLM's ``/metrics`` text."""
    return summed(exposition, _transfer_key)


def _transfer_key(name: str, labels: str) -> str | None:
    if name == _BY_SOURCE:
        return labels.partition('source="')[2].partition('"')[0] or None
    return FAILURES.get(name)


@dataclass(frozen=True)
class Sample:
    """One scrape: when, vLLM's counters, and the decode-only prompt tokens sent so far."""

    at: float
    counters: Mapping[str, float]
    alone: float = 0.0


@dataclass(frozen=True)
class Share:
    """What a window of samples says: tokens recomputed, tokens handed over, failures."""

    recomputed: float
    handed: float
    failures: Mapping[str, float]

    @property
    def ratio(self) -> float:
        return self.recomputed / self.handed if self.handed > 0 else 0.0


def share_between(first: Sample, last: Sample) -> Share | None:
    """The share between two samples; None when a counter went back (vLLM restarted)."""
    before = first.counters
    delta = {key: value - before.get(key, 0.0) for key, value in last.counters.items()}
    if any(value < 0 for value in delta.values()):
        return None
    alone = max(0.0, last.alone - first.alone)
    prompt = sum(delta.get(source, 0.0) for source in SOURCES)
    recomputed = max(0.0, delta.get("local_compute", 0.0) - alone)
    failures = {name: delta[name] for name in FAILURES.values() if delta.get(name, 0.0) > 0}
    return Share(recomputed, max(0.0, prompt - alone), failures)


@dataclass
class Watch:
    """One instance's samples over the window, and whether an episode is open."""

    samples: deque[Sample] = field(default_factory=deque)
    episode: bool = False
    #: Episodes begun so far.
    episodes: int = 0
    #: The window's share, once two samples are in.
    share: Share | None = None

    def add(self, sample: Sample) -> str | None:
        """Take a scrape; ``began`` or ``ended`` when an episode did, else None."""
        while self.samples and self.samples[0].at < sample.at - WINDOW:
            self.samples.popleft()
        self.samples.append(sample)
        share = share_between(self.samples[0], sample)
        if share is None:  # a restart: its counters start again from here
            self.samples.clear()
            self.samples.append(sample)
            share = Share(0.0, 0.0, {})
        self.share = share
        if not self.episode and share.ratio >= RAISE_AT and share.recomputed >= LEAST_TOKENS:
            self.episode = True
            self.episodes += 1
            return "began"
        if self.episode and share.handed >= LEAST_TOKENS and share.ratio < CLEAR_BELOW:
            self.episode = False
            return "ended"
        return None


def likely_causes(decode: Mapping[str, float], prefills: Iterable[tuple[str, Share]]) -> str:
    """The warning's causes: first those vLLM's own counters point to, then the silent ones.

    ``decode``: decode's failures in the window; ``prefills``: each prefill instance's share.
    """
    prefilled = list(prefills)
    said: list[str] = []
    expired = [(url, s.failures.get("expired_leases", 0)) for url, s in prefilled]
    expired = [(url, count) for url, count in expired if count]
    if expired:
        on = ", ".join(f"{url} {count:g}" for url, count in expired)
        said.append(
            f"KV leases that expired on prefill before decode pulled them ({on}: a decode "
            "that never pulled, or pulled past VLLM_NIXL_ABORT_REQUEST_TIMEOUT)"
        )
    failed = [("decode", decode.get("failed_transfers", 0))]
    failed += [(url, s.failures.get("failed_transfers", 0)) for url, s in prefilled]
    failed = [(where, count) for where, count in failed if count]
    if failed:
        on = ", ".join(f"{where} {count:g}" for where, count in failed)
        said.append(f"NIXL transfers or handshakes that failed ({on})")
    said.append(
        "a NIXL handshake that fails: a prefill's side channel (remote_host:remote_port of "
        "its kv_transfer_params, VLLM_NIXL_SIDE_CHANNEL_HOST/PORT) unreachable from decode, "
        "or prefill and decode on NIXL versions that do not match"
    )
    said.append(
        "kv_transfer_params decode does not pull with (do_remote_prefill dropped on the way, "
        "its log: 'invalid KVTransferParams')"
    )
    return "; ".join(said)


class Transfers:
    """Every instance's ``Watch``, fed by the health loop's scrapes; decode's judged.

    A decode instance's share and its episodes are kept on it
    (``Instance.recompute``, ``recompute_episodes``: what ``/metrics`` shows and the
    workers are told); the prefill instances' failures go into decode's warning.
    """

    def __init__(self) -> None:
        self._watches: dict[Instance, Watch] = {}

    def keep(self, instances: Iterable[Instance]) -> None:
        """Forget the watches of instances gone from the pools."""
        kept = set(instances)
        for gone in [i for i in self._watches if i not in kept]:
            del self._watches[gone]

    def scraped(self, instance: Instance, exposition: str, at: float) -> bool:
        """A scrape of ``instance``'s ``/metrics`` text at ``at``; True if what
        ``instance`` shows changed (its share, its episodes)."""
        watch = self._watches.setdefault(instance, Watch())
        happened = watch.add(Sample(at, transfer_counters(exposition), instance.alone_tokens))
        if instance.role != "decode" or watch.share is None:
            return False
        share = watch.share
        shown = (instance.recompute, instance.recompute_episodes)
        instance.recompute = share.ratio
        instance.recompute_episodes = watch.episodes
        if happened == "began":
            prefills = [
                (i.url, w.share)
                for i, w in self._watches.items()
                if i.role == "prefill" and w.share is not None
            ]
            log.warn(
                "decode instance {url} computed {ratio:.0%} of the prompt tokens of P/D legs "
                "itself over the last {window:g} s ({recomputed:.0f} of {handed:.0f}): the KV "
                "handoff is failing and each of those prompts is computed twice. Likely causes: "
                "{causes}",
                url=instance.url,
                ratio=share.ratio,
                window=WINDOW,
                recomputed=share.recomputed,
                handed=share.handed,
                causes=likely_causes(share.failures, prefills),
            )
        elif happened == "ended":
            log.info(
                "decode instance {url} pulls the KV of P/D legs again ({ratio:.0%} computed "
                "itself over the last {window:g} s)",
                url=instance.url,
                ratio=share.ratio,
                window=WINDOW,
            )
        return shown != (instance.recompute, instance.recompute_episodes)
