"""Routing policies side by side on seeded workloads (``bench.workloads``), fakes or real vLLM.

The fakes (one process, one shared ledger, pinned off the proxy's core)
model vLLM's prefix cache, publish its KV events over ZeroMQ once each
prompt's compute has run (as vLLM publishes a step's), and take ``--cost``
seconds per prompt token they had to compute. For each run it prints the
prefill prefix-cache hit rate (hits / queries in tokens, from the prefill
instances' own ``/metrics``, read before and after), that rate over the
ideal's (one prefill instance, where every prompt finds what any earlier
one computed), TTFT p50/p99 as the client saw it (streaming), the prefill
legs each instance took (its own request counter) and the busiest one's
over an even share, the most prompt tokens one instance had to compute
(its cache missed them), and failures.

Without ``--prefills``, the runs of 2026-12-03: each policy with 2 prefill
instances, round-robin, cache-aware and kv-aware with 4, both under
``--workers 2`` and with two proxies taking turns of the same
conversations, and one of two prefill instances 4x slower (least-loaded
and load must send it less than round-robin). With ``--prefills 2,4,8``:
ideal, round-robin, cache-aware and kv-aware at each count, and
vllm-project/router's ``cache_aware`` beside them with ``--vllm-router
PATH`` (its binary, from a virtualenv of its own: never a dependency);
``--repeat N`` runs the whole list N times.

With ``--shapes all`` (or some of them): every shape of ``bench.workloads``
(``SHAPES``: shared documents asked by new conversations one at a time,
growing conversations with a long shared system prompt, vLLM's own
prefix_repetition, and the mixed traffic with short prompts), each at its
own instances and requests in flight, or at each of ``--instances 2,4,8``
and ``--in-flight 1,4``: the ideal, round-robin, cache-aware and kv-aware
(and vllm-router with ``--vllm-router``) in one table, each policy's mean
hit rate over the ideal's and its worst seed's, and the busiest instance's
legs over an even share. Against real vLLM (``--real-prefill``) the shapes
take shorter texts (``bench.workloads.REAL``), to fit a 2,048-token context.
With ``--replicas N`` (``bench.replicas_routing``): for ``cache-aware`` and
``kv-aware``, one proxy against N taking each turn at random, alone and
sharing one routing view through a redis-server of the run's own
(``--replicas-redis``).

    python -m bench.routing [--workload chat|documents|mixed] [--conversations 24] [--turns 6]
    python -m bench.routing --shapes all --seeds 1,2,3 [--instances 2,4,8 --in-flight 1,4]
    python -m bench.routing --shapes all --seeds 1,2,3 --replicas 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from bench.indexes import index_memory, kv_index_memory
from bench.replicas_routing import replicas_table
from bench.routing_run import Run, measure, serve_fakes
from bench.workloads import SHAPES, at

RUNS = (
    Run("ideal (1 prefill)", prefills=1),
    *(
        Run(f"{p}, 2 prefills", policy=p)
        for p in ("round-robin", "least-loaded", "load", "cache-aware", "session")
    ),
    Run("kv-aware, 2 prefills", policy="kv-aware"),
    Run("round-robin, 4 prefills", prefills=4),
    Run("cache-aware, 4 prefills", prefills=4, policy="cache-aware"),
    Run("kv-aware, 4 prefills", prefills=4, policy="kv-aware"),
    Run("cache-aware, 2 prefills, --workers 2", policy="cache-aware", workers=2),
    Run("kv-aware, 2 prefills, --workers 2", policy="kv-aware", workers=2),
    Run("cache-aware, 2 prefills, 2 proxies", policy="cache-aware", proxies=2),
    *(
        Run(f"skew: {p}, one prefill 4x slower", policy=p, slow=True)
        for p in ("round-robin", "least-loaded", "load")
    ),
)


def matrix(counts: Sequence[int], router: bool) -> list[Run]:
    """Ideal, then round-robin, cache-aware, kv-aware (and vllm-router) at each count."""
    runs = [Run("ideal (1 prefill)", prefills=1)]
    for n in counts:
        runs += [
            Run(f"{p}, {n} prefills", n, p) for p in ("round-robin", "cache-aware", "kv-aware")
        ]
        if router:
            runs.append(Run(f"vllm-router cache_aware, {n} prefills", n, router="cache_aware"))
    return runs


# -- the fakes, served by a child process --------------------------------------


def shapes_table(args: argparse.Namespace) -> int:
    """Every shape at each count of instances and in flight: each policy's hit rate over the
    ideal's, and round-robin's, in one table (vllm-router's too, with ``--vllm-router``)."""
    names = [s.name for s in SHAPES] if args.shapes == "all" else args.shapes.split(",")
    counts = [int(n) for n in args.instances.split(",")] if args.instances else []
    flights = [int(n) for n in args.in_flight.split(",")] if args.in_flight else []
    seeds = [int(n) for n in args.seeds.split(",")] if args.seeds else [args.seed]
    policies = ["round-robin", "cache-aware", "kv-aware"]
    routers = ["cache_aware"] if args.vllm_router else []
    print(
        "| shape | instances | in flight | ideal | "
        + " | ".join([*policies, *(f"vllm-router {r}" for r in routers)])
        + " | busiest (ca, kv"
        + (", router" if routers else "")
        + ") |"
    )
    print("|---" * (5 + len(policies) + len(routers)) + "|")
    for name in names:
        base = next(s for s in SHAPES if s.name == name)
        for count in counts or [base.instances]:
            for flight in flights or [base.concurrency]:
                known = at(base, count, flight)
                rates: dict[str, list[float]] = {}
                ratios: dict[str, list[float]] = {}  # (each seed's over its own ideal)
                busiest: dict[str, list[float]] = {}
                for seed in seeds:
                    args.seed = seed
                    runs = [Run("ideal", prefills=1)]
                    runs += [Run(p, count, p) for p in policies]
                    runs += [Run(f"vllm-router {r}", count, router=r) for r in routers]
                    for run in runs:
                        r = measure(run, args, known)
                        rates.setdefault(run.name, []).append(r["hit_rate"] or 0.0)
                        busiest.setdefault(run.name, []).append(r["busiest"] or 0.0)
                        own = rates["ideal"][-1]
                        ratios.setdefault(run.name, []).append((r["hit_rate"] or 0.0) / own)
                ideal = statistics.mean(rates["ideal"])

                def cell(
                    name: str,
                    rates: dict[str, list[float]] = rates,
                    ratios: dict[str, list[float]] = ratios,
                ) -> str:
                    mean, over = statistics.mean(rates[name]), ratios[name]
                    return f"{mean:.3f} ({statistics.mean(over):.3f}, min {min(over):.3f})"

                shown = ["cache-aware", "kv-aware", *(f"vllm-router {r}" for r in routers)]
                cells = [cell(p) for p in [*policies, *(f"vllm-router {r}" for r in routers)]]
                print(
                    f"| {name} | {count} | {flight} | {ideal:.3f} | "
                    + " | ".join(cells)
                    + " | "
                    + ", ".join(f"{statistics.mean(busiest[p]):.2f}" for p in shown)
                    + " |",
                    flush=True,
                )
    return 0


def row(r: dict[str, Any], ideal: float | None) -> str:
    ratio = f"{r['hit_rate'] / ideal:.3f}" if ideal and r["hit_rate"] is not None else "-"
    cells = [
        r["run"],
        f"{r['hit_rate']:.1%}" if r["hit_rate"] is not None else "-",
        ratio,
        f"{r['ttft_p50_ms']} ms",
        f"{r['ttft_p99_ms']} ms",
        str(r["prefill_legs"]),
        f"{r['busiest']:.2f}" if r["busiest"] is not None else "-",
        f"{r['most_computed']:,}",
        str(r["failures"]),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("chat", "documents", "mixed"), default="chat")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--documents", type=int, default=6, help="documents: how many")
    parser.add_argument("--doc-words", type=int, default=1200, help="documents: words each")
    parser.add_argument(
        "--opening-bytes", type=int, default=900, help="chat: each conversation's own opening"
    )
    parser.add_argument(
        "--follow-up-words", type=int, default=80, help="the words each turn after the first adds"
    )
    parser.add_argument(
        "--real-prefill",
        action="append",
        default=[],
        help="a real vLLM prefill instance instead of the fakes (repeat; #kv-events=PORT)",
    )
    parser.add_argument("--real-decode", action="append", default=[], help="with --real-prefill")
    parser.add_argument("--model", default="fake-model", help="the model name the requests ask for")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cost", type=float, default=0.0001, help="s per uncached token")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--only", default="", help="runs whose name contains this")
    parser.add_argument("--prefills", default="", help="e.g. 2,4,8: the policies at each count")
    parser.add_argument("--vllm-router", default="", help="vllm-router's binary, to run beside")
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="an option for every nixlproxy run"
    )
    parser.add_argument("--seeds", default="", help="e.g. 1,2,3: the whole list with each seed")
    parser.add_argument(
        "--proxy-python",
        default="",
        help="another build's python (its virtualenv's), whose nixlproxy runs instead",
    )
    parser.add_argument("--repeat", type=int, default=1, help="the whole list, this many times")
    parser.add_argument(
        "--shapes",
        default="",
        help="all, or e.g. documents,mixed: each shape of bench.workloads in one table",
    )
    parser.add_argument("--instances", default="", help="--shapes: e.g. 2,4,8 (its own: none)")
    parser.add_argument("--in-flight", default="", help="--shapes: e.g. 1,4 (its own: none)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="--shapes: one proxy against N taking requests at random, alone and sharing "
        "their routing view through a redis-server (--replicas-redis)",
    )
    parser.add_argument("--serve-fakes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--slow", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--index-memory",
        action="store_true",
        help="what cache-aware keeps after 100k distinct prompts",
    )
    parser.add_argument(
        "--kv-index-memory",
        action="store_true",
        help="what kv-aware's index keeps per block, and the time to match a prompt",
    )
    args = parser.parse_args(argv)
    if args.kv_index_memory:
        print(json.dumps(kv_index_memory()))
        return 0
    if args.index_memory:
        print(json.dumps(index_memory()))
        return 0
    if args.serve_fakes:
        serve_fakes(args.serve_fakes, 2, args.cost, args.slow)
        return 0
    if args.proxy_python:
        _proxy_from(args.proxy_python)
    if args.shapes and args.replicas:
        return replicas_table(args)
    if args.shapes:
        return shapes_table(args)
    if args.prefills:
        runs = matrix([int(n) for n in args.prefills.split(",")], bool(args.vllm_router))
    else:
        runs = list(RUNS)
    columns = ("prefill hit rate", "x ideal", "TTFT p50", "TTFT p99", "prefill legs", "busiest")
    print(f"| run | {' | '.join(columns)} | most computed | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    rounds: dict[str, list[tuple[float, float, int]]] = {}
    seeds = [int(n) for n in args.seeds.split(",")] if args.seeds else [args.seed]
    for seed in [n for n in seeds for _ in range(args.repeat)]:
        args.seed = seed
        ideal: float | None = None
        for run in runs:
            if args.only and args.only not in run.name and run.prefills != 1:
                continue
            r = measure(run, args)
            if run.prefills == 1:
                ideal = r["hit_rate"]
            elif ideal and r["hit_rate"] is not None and r["busiest"] is not None:
                said = (r["hit_rate"] / ideal, r["busiest"], r["most_computed"])
                rounds.setdefault(run.name, []).append(said)
            print(row(r, ideal), flush=True)
    if len(seeds) * args.repeat > 1:
        summary(rounds)
    return 0


def summary(rounds: dict[str, list[tuple[float, float, int]]]) -> None:
    """Each run over every round: its share of the ideal, the busiest's legs, its work."""
    print()
    print("| run | rounds | x ideal, min / mean | busiest, mean / max | most computed, mean |")
    print("|---|---|---|---|---|")
    for name, said in rounds.items():
        ratios, busiest, computed = zip(*said, strict=True)
        cells = [
            name,
            str(len(said)),
            f"{min(ratios):.3f} / {statistics.mean(ratios):.3f}",
            f"{statistics.mean(busiest):.2f} / {max(busiest):.2f}",
            f"{statistics.mean(computed):,.0f}",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


def _proxy_from(python: str) -> None:
    """Run another build's proxy: ``python`` of its own virtualenv, run from ``/`` so that it
    imports its own package, not this tree's (the fakes stay this tree's)."""
    from bench import run

    run.PROXY_TWISTD = (python, "-c", "from twisted.scripts.twistd import run; run()")
    run.PROXY_CWD = "/"


if __name__ == "__main__":
    raise SystemExit(main())
