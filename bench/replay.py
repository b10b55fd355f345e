"""A routing shape replayed in memory: the proxy's own pool and policies before the fakes'
prefix caches, on simulated time.

What ``bench.routing`` measures with processes over loopback (or real vLLM),
this replays in a few milliseconds and the same every time: each turn of a
seeded workload (``bench.workloads``) is read as the door reads it
(``Completion``), offered to the prefill pool's policy as a leg would be
(``routing_for``; kv-aware's token ids as vLLM's render gives them), leased
on the instance chosen, looked up and stored in that instance's fake prefix
cache (``nixl_twisted.testing.prefix_cache``: vLLM's blocks of 128 tokens
and its counters), and held until its compute ends: each instance computes
its legs one after another, ``cost`` seconds a token its cache missed plus
``overhead`` a leg. Its KV events reach the pool's index when the compute
ends, as vLLM publishes a step's. ``concurrency`` turns are in flight at once,
a conversation's turns one after the other.

It is the suite's guard (``tests/pure/test_routing_shapes.py``: a hit rate is
a count, so no clock is read) and a quick table:

    python -m bench.replay [--seeds 1,2,3] [--proxy-arg cache_aware_margin=2]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor
from twisted.web.client import Agent

from bench.workloads import ANSWER, FAKES, SHAPES, Shape, Sizes, at, body, next_turn, order
from nixl_twisted.backends.policies import needs
from nixl_twisted.backends.pools import BackendPool, Lease
from nixl_twisted.backends.prompt_keys import routing_for
from nixl_twisted.backends.service import BackendService
from nixl_twisted.backends.upstream import Upstream
from nixl_twisted.config import ProxyConfig
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.kv.wire import decode_batch
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.testing.prefix_cache import PrefixCache, prompt_tokens

#: The policies a shape is replayed with, besides the ideal (one instance).
POLICIES = ("round-robin", "cache-aware", "kv-aware")


class _Subscribed(KvEvents):
    """kv-aware's holdings, fed by the replay's fakes instead of ZeroMQ: every instance's
    events are read and none is stale."""

    def listening(self, role: str, url: str) -> bool:
        return True

    def stale(self, role: str, url: str) -> bool:
        return False


@dataclass
class Replayed:
    """What one replay measured: the prefill caches' counters, and where the legs went."""

    hits: int
    queries: int
    legs: list[int]
    decisions: Counter[str]
    #: Each leg's simulated seconds from its routing to the end of its compute.
    waits: list[float]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def busiest(self) -> float:
        """The busiest instance's legs over an even share."""
        return max(self.legs) / (sum(self.legs) / len(self.legs)) if sum(self.legs) else 0.0

    def wait(self, share: float) -> float:
        """The ``share`` quantile of the legs' simulated waits, in milliseconds."""
        ordered = sorted(self.waits)
        return 1000 * ordered[int(share * (len(ordered) - 1))] if ordered else 0.0


def replay(
    shape: Shape,
    policy: str,
    seed: int,
    settings: dict[str, Any] | None = None,
    sizes: Sizes = FAKES,
    cost: float = 0.0001,
    overhead: float = 0.002,
    block_tokens: int = 128,
) -> Replayed:
    """``shape`` through a prefill pool of ``policy`` (one instance: ``"ideal"``)."""
    count = 1 if policy == "ideal" else shape.instances
    urls = [f"http://prefill-{n}:8100" for n in range(count)]
    clock = Clock()
    config = ProxyConfig.create(
        prefill=urls,
        decode=["http://decode-0:8200"],
        prefill_policy="round-robin" if policy == "ideal" else policy,
        health_interval=0,
        **(settings or {}),
    )
    held = _Subscribed(MemoryReactor(), clock, (), config)
    pool = BackendPool("prefill", urls, clock)
    decode = BackendPool("decode", ["http://decode-0:8200"], clock)
    BackendService(pool, decode, Upstream(Agent(MemoryReactor())), config, holdings=held)
    index = held.index("prefill")
    caches = {
        url: PrefixCache(block_tokens, 1 << 20, seed=url.encode(), on_events=lambda events: None)
        for url in urls
    }
    rng = random.Random(seed)
    made = shape.made(rng, sizes)
    waiting = order(made, rng)
    histories = made.histories
    done = [0] * len(histories)
    busy_until = dict.fromkeys(urls, 0.0)
    #: Legs in flight: (when its compute ends, a tiebreak, what it holds).
    flying: list[tuple[float, int, Lease, int, list[dict[str, Any]]]] = []
    busy: set[int] = set()
    reads = needs((config.policies.prefill,))
    legs: Counter[str] = Counter()
    decisions: Counter[str] = Counter()
    waits: list[float] = []
    now = 0.0
    sent = 0

    def start(n: int) -> None:
        nonlocal sent
        sent_body = body(histories[n], "fake-model", n, stream=False)
        path = "/v1/completions" if "prompt" in sent_body else "/v1/chat/completions"
        completion = Completion(path, sent_body, f"replay-{sent}")
        tokens = prompt_tokens(sent_body)
        routing = routing_for(reads, config.policies.key_bytes, None, completion)
        if reads.token_ids:  # (as vLLM's render endpoint gives them)
            routing = replace(routing, tokens=tuple(tokens))
        instance, decision = pool.choose(routing=routing)
        lease = pool.lease(instance, decision)
        legs[instance.url] += 1
        decisions[decision] += 1
        events: list[dict[str, Any]] = []
        cache = caches[instance.url]
        cache.on_events = events.extend
        cached, total = cache.compute(tokens)
        begins = max(now, busy_until[instance.url])
        ends = busy_until[instance.url] = begins + overhead + cost * (total - cached)
        waits.append(ends - now)
        heapq.heappush(flying, (ends, sent, lease, n, events))
        sent += 1
        busy.add(n)

    def fill() -> None:
        while len(busy) < shape.concurrency:
            pick = next((i for i, n in enumerate(waiting) if n not in busy), None)
            if pick is None:
                return
            start(waiting.pop(pick))

    fill()
    while flying:
        ends, _, lease, n, events = heapq.heappop(flying)
        now = ends
        clock.advance(max(0.0, now - clock.seconds()))
        if events:
            index.apply(lease.instance.url, decode_batch(msgpack.packb([now, events, 0])))
        lease.release()
        histories[n] = next_turn(histories[n], done[n], ANSWER, sizes.follow_up)
        done[n] += 1
        busy.discard(n)
        fill()
    return Replayed(
        sum(c.hits for c in caches.values()),
        sum(c.queries for c in caches.values()),
        [legs[url] for url in urls],
        decisions,
        waits,
    )


def table(
    shapes: Sequence[Shape], seeds: Sequence[int], settings: dict[str, Any] | None = None
) -> list[str]:
    """Every shape's hit rate for each policy against the ideal and round-robin."""
    lines = [
        "| shape | instances | in flight | ideal | round-robin | cache-aware | kv-aware "
        "| busiest (cache-aware, kv-aware) | wait p99, ms (ideal, rr, ca, kv) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for known in shapes:
        rates: dict[str, list[float]] = {}
        busiest: dict[str, list[float]] = {}
        tails: dict[str, list[float]] = {}
        for seed in seeds:
            for policy in ("ideal", *POLICIES):
                said = replay(known, policy, seed, settings)
                rates.setdefault(policy, []).append(said.hit_rate)
                busiest.setdefault(policy, []).append(said.busiest)
                tails.setdefault(policy, []).append(said.wait(0.99))
        ideal = statistics.mean(rates["ideal"])

        def cell(policy: str, rates: dict[str, list[float]] = rates, ideal: float = ideal) -> str:
            mean = statistics.mean(rates[policy])
            return f"{mean:.3f} ({mean / ideal:.3f})" if ideal else f"{mean:.3f}"

        lines.append(
            f"| {known.name} | {known.instances} | {known.concurrency} | {ideal:.3f} | "
            + " | ".join(cell(p) for p in POLICIES)
            + f" | {statistics.mean(busiest['cache-aware']):.2f}, "
            f"{statistics.mean(busiest['kv-aware']):.2f} | "
            + ", ".join(f"{statistics.mean(tails[p]):.0f}" for p in ("ideal", *POLICIES))
            + " |"
        )
    return lines


def matrix(counts: Sequence[int], concurrencies: Sequence[int]) -> list[Shape]:
    """Every shape at each count of instances and each count in flight."""
    return [at(s, n, c) for s in SHAPES for n in counts for c in concurrencies]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--instances", default="2,4,8")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument(
        "--setting", action="append", default=[], help="a proxy setting, NAME=VALUE"
    )
    args = parser.parse_args(argv)
    settings: dict[str, Any] = {}
    for said in args.setting:
        name, _, value = said.partition("=")
        settings[name] = float(value) if "." in value else int(value)
    shapes = matrix(
        [int(n) for n in args.instances.split(",")], [int(c) for c in args.concurrency.split(",")]
    )
    for line in table(shapes, [int(s) for s in args.seeds.split(",")], settings):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
