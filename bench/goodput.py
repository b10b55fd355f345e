"""Goodput under first-token targets: the fleet's decode capacity against what is served in time.

Issue 56's yardstick. ``bench.overload``'s fleet of fakes with vLLM's
capacity (``--max-num-seqs`` streams run at once per instance, the rest
wait inside it; a prefill takes time in proportion to the prompt's tokens)
before one proxy, or ``--replicas N`` (``--shared``: on a real Redis, as
``bench.replicas``), caps at ``--max-num-seqs`` with the queue and the
tenants' weights (``a`` 3 : ``b`` 1, sending the same amount). Open-loop
arrivals at ``--load`` times the fleet's **decode capacity** (decodes x
``--max-num-seqs`` / a stream's seconds: what the decode engines can
complete, whatever the proxy does before them). Each request carries a
first-token target in ``x-slo-ttft-ms`` (``--targets``), which the proxy's
queue schedules by: the earliest deadline first within a tenant, a request
predicted to miss its target refused at once.

The workload shapes (``--shapes``), 32 tokens 20 ms apart (0.66 s a stream):

- ``today``: the fakes of ``performance.md``: 258-token prompts, 0.13 s of prefill;
- ``third``: the issue's: 258-token prompts, 0.3 s of prefill (a third of a request);
- ``half``: long prompts: 1,000 tokens, 0.66 s of prefill (a half), 3 prefill instances;
- ``mixed``: a quarter of the prompts 1,000 tokens (0.8 s), the rest 258 (0.21 s).

Per run: the decode capacity, what was offered and served a second,
**goodput** (first token within its own target and within the arrival
window) a second and as a share of the decode capacity, the share of the
served that were late (per target), the share refused and how many of the
refusals came within their requester's target, the decode engines' busy
share (``vllm:num_requests_running`` over their slots, sampled) and what
waited inside them (``vllm:num_requests_waiting``: mean / max), the
tenants' served ratio against their weights', and first-token p50 / p99.

    python -m bench.goodput --load 3                       # every shape, one proxy, 20 s each
    python -m bench.goodput --load 3 --replicas 2 --shared
    python -m bench.goodput --load 2 --targets 1000:0.5,10000:0.5 --shapes third
    python -m bench.goodput --smoke                        # 12 arrivals at 1x, small fakes
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

from bench import open_loop
from bench.overload import FILLER, TENANT_HEADER, TENANTS, Fleet, caps_options, fakes, summary
from bench.replicas import aimed, proxies
from nixl_twisted.testing.prefix_cache import prompt_tokens

#: The header the targets go in (llm-d's older name; the proxy reads it and its aliases).
TARGET_HEADER = "x-slo-ttft-ms"


@dataclass(frozen=True)
class Shape:
    """A workload: its prompts (a share of them long) and the fakes' costs."""

    name: str
    prompt: int
    prefill_cost: float
    long_prompt: int = 0
    long_share: float = 0.0
    prefills: int = 2
    tokens: int = 32
    token_interval: float = 0.02

    def tokens_of(self, number: int) -> int:
        """Request ``number``'s prompt tokens: long ones spread evenly (golden-ratio steps)."""
        return self.long_prompt if (number * 0.6180339887) % 1 < self.long_share else self.prompt

    def body(self, number: int, tenant: str) -> dict[str, Any]:
        """Its own prompt (no prefix cache hit), of ``tokens_of(number)`` tokens."""
        head = f"Request {number} from tenant {tenant}. "
        made = {"model": "fake-model", "stream": True, "max_tokens": self.tokens}
        bare = len(prompt_tokens({**made, "messages": [{"role": "user", "content": ""}]}))
        text = (head + FILLER * (1 + 4 * self.tokens_of(number) // len(FILLER)))[
            : max(len(head), 4 * (self.tokens_of(number) - bare))
        ]
        return {**made, "messages": [{"role": "user", "content": text}]}

    @property
    def prefill_seconds(self) -> float:
        """A prompt's mean prefill (over the first 1,000 requests)."""
        tokens = [len(prompt_tokens(self.body(n, "a"))) for n in range(0, 1000, 10)]
        return statistics.fmean(tokens) * self.prefill_cost


SHAPES = {
    "today": Shape("today", 258, 0.0005),
    "third": Shape("third", 258, 0.3 / 258),
    "half": Shape("half", 1000, 0.00066, prefills=3),
    "mixed": Shape("mixed", 258, 0.0008, long_prompt=1000, long_share=0.25),
}


def targets_of(spec: str) -> list[tuple[float, float]]:
    """``--targets``: ``MS:SHARE,...`` (shares summing to 1), or one ``MS`` for all; as
    (seconds, share) pairs."""
    pairs = []
    for part in spec.split(","):
        ms, _, share = part.partition(":")
        pairs.append((float(ms) / 1000, float(share) if share else 1.0))
    if any(s <= 0 or t <= 0 for t, s in pairs) or abs(sum(s for _, s in pairs) - 1) > 1e-6:
        raise ValueError(f"--targets {spec}: each MS and SHARE above 0, the shares summing to 1")
    return pairs


def targeted(
    planned: Sequence[open_loop.Arrival], targets: Sequence[tuple[float, float]]
) -> list[float]:
    """Each arrival's target in seconds: each tenant's k-th at golden-ratio steps through
    the shares, so that every tenant sends each target its share, spread over the window."""
    edges = list(itertools.accumulate(share for _, share in targets))
    counts: dict[str, int] = {}
    chosen = []
    for arrival in planned:
        k = counts[arrival.tenant] = counts.get(arrival.tenant, -1) + 1
        at = (k * 0.6180339887) % 1
        chosen.append(
            next((t for (t, _), e in zip(targets, edges, strict=True) if at < e), targets[-1][0])
        )
    return chosen


def figures(
    outcomes: Sequence[open_loop.Outcome],
    targets: Sequence[float],
    gauges: open_loop.Gauges,
    window: float,
    fleet: Fleet,
) -> dict[str, Any]:
    """One run's figures: ``bench.overload``'s summary (its bound: none) and each
    request's own target."""
    said = summary(outcomes, gauges, window, fleet.decode_rate, math.inf)
    paired = list(zip(outcomes, targets, strict=True))
    served = [(o, t) for o, t in paired if o.served and o.ttft is not None]
    good = [o for o, t in served if o.ttft is not None and o.ttft <= t]
    on_time = [o for o in good if o.first_at is not None and o.first_at <= window]
    refused = [(o, t) for o, t in paired if not (o.served and o.ttft is not None)]
    inside = [
        o for o, t in refused if o.status >= 400 and o.answered is not None and o.answered <= t
    ]
    late = {
        f"{target:g} s": round(
            sum(o.ttft is not None and o.ttft > t for o, t in mine) / len(mine), 3
        )
        for target in sorted(set(targets))
        if (mine := [(o, t) for o, t in served if t == target])
    }
    busy = gauges.running.get("decode") or [0.0]
    shares = said["served_shares"]
    return {
        "requests": len(outcomes),
        "served": len(served),
        "served_per_s": said["goodput"],
        "goodput": round(len(on_time) / window, 2),
        "goodput_share": round(len(on_time) / window / fleet.decode_rate, 3),
        "late_share": round(1 - len(good) / len(served), 3) if served else 0.0,
        "late_by_target": late,
        "refused_share": round(len(refused) / max(1, len(outcomes)), 3),
        "refused": said["refused"],
        "refused_inside_target": len(inside),
        "refusals": len(refused),
        "refusals_with_retry_after": said["refusals_with_retry_after"],
        "refused_by_code": dict(
            collections.Counter(f"{o.status} {o.code or '-'}" for o, _ in refused).most_common()
        ),
        "decode_busy": round(statistics.fmean(busy) / (fleet.decodes * fleet.max_num_seqs), 3),
        "waiting": said["waiting"],
        "served_shares": shares,
        "served_ratio": round(shares["a"] / shares["b"], 2) if shares["b"] else None,
        "ttft_p50_s": said["ttft_p50_s"],
        "ttft_p99_s": said["ttft_p99_s"],
        "lag_max_s": said["lag_max_s"],
    }


def fleet_of(shape: Shape, args: argparse.Namespace) -> Fleet:
    return Fleet(
        args.prefills or shape.prefills,
        args.decodes,
        args.max_num_seqs,
        shape.tokens,
        shape.token_interval,
        shape.prefill_cost,
    )


def measure(shape: Shape, args: argparse.Namespace, seed: int, folder: str) -> dict[str, Any]:
    """One run of ``shape``: fakes, proxies (and Redis) started for it, stopped after."""
    fleet = fleet_of(shape, args)
    rate = args.load * fleet.decode_rate
    planned = open_loop.arrivals(rate, list(TENANTS), seed, shape.body, args.seconds, args.requests)
    window = args.seconds if args.requests is None else planned[-1].at
    targets = targeted(planned, targets_of(args.targets))
    planned = [
        replace(a, headers=((TARGET_HEADER, f"{t * 1000:.0f}"),))
        for a, t in zip(planned, targets, strict=True)
    ]
    planned = aimed(planned, args.replicas, args.pinned, None, seed)
    cap = args.caps if args.caps is not None else fleet.max_num_seqs
    options = [
        *("--tenant-header", TENANT_HEADER),
        *caps_options(cap, args.queue_size, args.queue_timeout, folder),
        *args.proxy_arg,
    ]
    with ExitStack() as stack:
        urls = stack.enter_context(fakes(fleet))
        served, _ = proxies(stack, urls, options, args.replicas, args.shared)
        began = time.strftime("%H:%M:%S")  # (to read against what else loaded the machine)
        outcomes, gauges, elapsed = asyncio.run(
            open_loop.run(
                [url for url, _ in served], planned, urls, TENANT_HEADER, args.client_timeout
            )
        )
    return {
        "shape": shape.name,
        "proxies": f"{args.replicas} shared" if args.shared else str(args.replicas),
        "load": args.load,
        "seed": seed,
        "began": began,
        "decode_capacity": round(fleet.decode_rate, 2),
        "prefill_capacity": round(fleet.prefills * fleet.max_num_seqs / shape.prefill_seconds, 2),
        "offered": round(rate, 2),
        "elapsed_s": round(elapsed, 1),
        **figures(outcomes, targets, gauges, window, fleet),
    }


HEADER = (
    "| shape | proxies | load | decode capacity | offered | served | goodput (of capacity) "
    "| late of served | refused (inside own target) | with Retry-After | decode busy "
    "| waiting in decode mean / max | served a : b (weights 3 : 1) | TTFT p50 / p99 |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(result: dict[str, Any]) -> str:
    late = result["late_by_target"]
    by = f" ({', '.join(f'{t}: {s:.0%}' for t, s in late.items())})" if len(late) > 1 else ""
    waiting = result["waiting"]["decode"]
    cells = [
        result["shape"],
        result["proxies"],
        f"{result['load']:g}x",
        f"{result['decode_capacity']:g}/s",
        f"{result['offered']:g}/s",
        f"{result['served_per_s']:g}/s",
        f"{result['goodput']:g}/s ({result['goodput_share']:.0%})",
        f"{result['late_share']:.0%}{by}",
        f"{result['refused_share']:.0%} ({result['refused_inside_target']} of "
        f"{result['refusals']})",
        str(result["refusals_with_retry_after"]),
        f"{result['decode_busy']:.0%}",
        f"{waiting['mean']:g} / {waiting['max']:g}",
        f"{result['served_ratio']} : 1" if result["served_ratio"] is not None else "-",
        f"{result['ttft_p50_s']} / {result['ttft_p99_s']} s",
    ]
    return "| " + " | ".join(cells) + " |"


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), metavar="A,B", help="of " + ", ".join(SHAPES)
    )
    parser.add_argument("--load", type=float, default=3.0, help="times the decode capacity")
    parser.add_argument(
        "--targets",
        default="5500",
        metavar="MS[:SHARE],...",
        help="first-token targets in x-slo-ttft-ms: 5500 (all), 1000:0.5,10000:0.5 (half each)",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float, default=20.0, help="of arrivals, per run")
    length.add_argument("--requests", type=int, help="instead: this many arrivals per run")
    parser.add_argument("--seed", type=int, default=56)
    parser.add_argument("--repeat", type=int, default=1, help="each shape N times, seeds +1")
    parser.add_argument("--client-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--smoke", action="store_true", help="12 arrivals at 1x, small fakes")
    parser.add_argument("--json", action="store_true", help="print the raw results too")
    fleet = parser.add_argument_group("the fakes")
    fleet.add_argument("--prefills", type=int, help="prefill instances (the shape's: 2, half 3)")
    fleet.add_argument("--decodes", type=int, default=2)
    fleet.add_argument("--max-num-seqs", type=int, default=8)
    where = parser.add_argument_group("the proxies")
    where.add_argument("--replicas", type=int, default=1)
    where.add_argument("--shared", action="store_true", help="--replicas-redis on a real Redis")
    where.add_argument("--pinned", type=float, default=0.9, help="a tenant's share to its own")
    where.add_argument("--caps", type=int, help="both caps (default: --max-num-seqs)")
    where.add_argument("--queue-size", type=int, default=64)
    where.add_argument("--queue-timeout", type=float, default=4.0, metavar="SECONDS")
    where.add_argument("--proxy-arg", action="append", default=[], help="one more option")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    names = args.shapes.split(",")
    if unknown := [n for n in names if n not in SHAPES]:
        parser.error(f"--shapes: {', '.join(unknown)} unknown (of {', '.join(SHAPES)})")
    try:
        targets_of(args.targets)
    except ValueError as bad:
        parser.error(str(bad))
    shapes = [SHAPES[n] for n in names]
    if args.smoke:
        args.requests, args.load, args.max_num_seqs = 12, 1.0, 2
        shapes = [replace(s, tokens=4, token_interval=0.05) for s in shapes]
    print(
        f"targets {args.targets} ms ({TARGET_HEADER}); tenants a and b weighted 3 : 1, sending "
        f"the same amount; caps {args.caps or args.max_num_seqs}, queue {args.queue_size} / "
        f"{args.queue_timeout:g} s; "
        + (f"{args.seconds:g} s" if args.requests is None else f"{args.requests}")
        + f" arrivals at {args.load:g}x"
    )
    for shape in shapes:
        fleet = fleet_of(shape, args)
        print(
            f"{shape.name}: {fleet.prefills} prefill + {fleet.decodes} decode x "
            f"{fleet.max_num_seqs}; prefill {shape.prefill_seconds:.3g} s (mean), a stream "
            f"{fleet.stream_seconds:.3g} s; decode capacity {fleet.decode_rate:.3g}/s, prefill "
            f"{fleet.prefills * fleet.max_num_seqs / shape.prefill_seconds:.3g}/s"
        )
    print(HEADER, flush=True)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for shape in shapes:
            for run in range(args.repeat):
                results.append(measure(shape, args, args.seed + run, folder))
                print(row(results[-1]), flush=True)
    for result in results:  # (each run's refusals by status and code, below the table)
        codes = ", ".join(f"{k} {v}" for k, v in result["refused_by_code"].items())
        print(f"refused, {result['shape']}: {codes or 'none'}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
