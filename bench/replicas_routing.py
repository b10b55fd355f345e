"""``bench.routing --shapes ... --replicas N``: N proxies taking requests at random against one.

For each shape of ``bench.workloads.SHAPES`` and each seed: the ideal (one
prefill instance), then for ``cache-aware`` and ``kv-aware`` one proxy, N
proxies each turn of every conversation sent to one drawn at random
(seeded, the same draw for both) each on its own memory, and the same N
sharing one routing view through a redis-server started for the run
(``--replicas-redis``; a fresh one each run, so nothing is kept from the
run before). Each row says the hit rates (and each over the ideal) and
what one routing view is for: the shared N's hit rate over one proxy's, its
mean and worst seed; and the busiest instance's prefill legs over an even
share, mean, in each of the three (the balance guard counts each proxy's
own legs, shared or not). Failed turns are said with why.

    python -m bench.routing --shapes all --seeds 1,2,3 --replicas 2
"""

from __future__ import annotations

import argparse
import statistics

from bench.routing_run import Run, measure
from bench.workloads import SHAPES, at

POLICIES = ("cache-aware", "kv-aware")
KINDS = ("one", "alone", "shared")


def replicas_table(args: argparse.Namespace) -> int:
    names = [s.name for s in SHAPES] if args.shapes == "all" else args.shapes.split(",")
    seeds = [int(n) for n in args.seeds.split(",")] if args.seeds else [args.seed]
    n = args.replicas
    print(
        f"| shape | instances | in flight | policy | ideal | 1 proxy | {n} at random, alone "
        f"| {n} at random, shared | shared / 1 proxy, mean (min) "
        "| busiest: 1 proxy, alone, shared |"
    )
    print("|---" * 10 + "|")
    for name in names:
        base = next(s for s in SHAPES if s.name == name)
        count = int(args.instances) if args.instances else base.instances
        flight = int(args.in_flight) if args.in_flight else base.concurrency
        known = at(base, count, flight)
        rates: dict[tuple[str, str], list[float]] = {}
        busiest: dict[tuple[str, str], list[float]] = {}
        for seed in seeds:
            args.seed = seed
            runs = [("ideal", "", Run("ideal", prefills=1))]
            for policy in POLICIES:
                runs += [
                    (policy, "one", Run(policy, count, policy)),
                    (policy, "alone", Run(policy, count, policy, proxies=n, at_random=True)),
                    (
                        policy,
                        "shared",
                        Run(policy, count, policy, proxies=n, at_random=True, shared=True),
                    ),
                ]
            for policy, kind, run in runs:
                said = measure(run, args, known)
                if said["failures"]:
                    why = "; ".join(said["why_failed"])
                    print(f"{name} seed {seed} {policy} {kind}: {said['failures']} failed: {why}")
                rates.setdefault((policy, kind), []).append(said["hit_rate"] or 0.0)
                busiest.setdefault((policy, kind), []).append(said["busiest"] or 0.0)
        ideal = rates[("ideal", "")]
        for policy in POLICIES:
            one, alone, shared = (rates[(policy, k)] for k in ("one", "alone", "shared"))
            ratios = [s / o for s, o in zip(shared, one, strict=True) if o]
            cells = [
                name,
                str(count),
                str(flight),
                policy,
                f"{statistics.mean(ideal):.3f}",
                *(_cell(r, ideal) for r in (one, alone, shared)),
                f"{statistics.mean(ratios):.3f} ({min(ratios):.3f})" if ratios else "-",
                ", ".join(f"{statistics.mean(busiest[(policy, k)]):.2f}" for k in KINDS),
            ]
            print("| " + " | ".join(cells) + " |", flush=True)
    return 0


def _cell(rates: list[float], ideal: list[float]) -> str:
    """The mean hit rate, and its mean over each seed's ideal."""
    over = [r / i for r, i in zip(rates, ideal, strict=True) if i]
    return f"{statistics.mean(rates):.3f} ({statistics.mean(over):.3f})"
