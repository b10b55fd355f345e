"""Past the fleet's capacity: open-loop arrivals at 0.5, 1, 2 and 3 times what it can serve.

The fakes have vLLM's capacity (``FakeVLLM(max_num_seqs=...)``: that many
streams run at once per instance, the rest wait inside it, first come first
served), a token interval and a prefill cost. The fleet's capacity is what
its decode instances can complete: decodes x ``--max-num-seqs`` / the
seconds one stream takes (a chat stream's role event, ``--tokens`` tokens
and ``[DONE]``, ``--token-interval`` apart), unless its prefill instances
can compute fewer prompts a second (prefills x ``--max-num-seqs`` / a
prompt's tokens x ``--prefill-cost``); both are printed. Two tenants,
weighted 3 : 1, send the same amount (header ``x-tenant``; ``--caps``
gives the proxy the weights as ``[tenants.NAME] weight = W``).

For each load: goodput (requests served within ``--ttft-bound`` of first
token, per second of arrivals, and as a share of the capacity), the served
requests' TTFT p50 and p99, the share refused by status (0: no answer at
all; 200: a stream that broke) and how many refusals said ``Retry-After``,
the requests waiting inside the engines (each role's
``vllm:num_requests_waiting`` summed over its instances, sampled every
0.25 s from the fakes' own ``/metrics`` until the last answer: mean and
max), each tenant's share of what was served and of what was served
within the bound, and the lines the proxy logged from its first request
to SIGTERM. Fakes and proxy are started anew for each load; the proxy
pinned to core 0, the fakes and this process on the others.

    python -m bench.overload                   # today's proxy, 20 s of arrivals per load
    python -m bench.overload --caps            # with issue 36's caps, queue and weights
    python -m bench.overload --vllm-router /tmp/vr-venv/bin/vllm-router   # its queue instead
    python -m bench.overload --requests 12 --tokens 4 --token-interval 0.005   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bench import open_loop
from bench.overload_targets import Target, TargetFailed, nixlproxy, vllm_router
from bench.run import served_fakes
from nixl_twisted.testing.prefix_cache import prompt_tokens

#: The tenants and their weights: each sends the same amount.
TENANTS = {"a": 3, "b": 1}
TENANT_HEADER = "x-tenant"
#: The loads, as multiples of the fleet's capacity.
LOADS = (0.5, 1.0, 2.0, 3.0)
#: Words of a prompt, after the words that make each prompt its own (no prefix cache hit).
FILLER = "Summarise what a disaggregated prefill and decode fleet does under overload. " * 13


@dataclass(frozen=True)
class Fleet:
    """The fakes' settings, and the capacity they make."""

    prefills: int
    decodes: int
    max_num_seqs: int
    tokens: int
    token_interval: float
    prefill_cost: float
    max_num_queued_reqs: int | None = None

    def body(self, number: int, tenant: str) -> dict[str, Any]:
        content = f"Request {number} from tenant {tenant}. {FILLER}"
        return {
            "model": "fake-model",
            "messages": [{"role": "user", "content": content}],
            "stream": True,
            "max_tokens": self.tokens,
        }

    @classmethod
    def of(cls, args: argparse.Namespace) -> Fleet:
        """The fleet the command line (``arguments``) describes."""
        return cls(
            args.prefills,
            args.decodes,
            args.max_num_seqs,
            args.tokens,
            args.token_interval,
            args.prefill_cost,
            args.max_num_queued_reqs,
        )

    @property
    def stream_seconds(self) -> float:
        return (self.tokens + 1) * self.token_interval

    @property
    def prefill_seconds(self) -> float:
        return len(prompt_tokens(self.body(0, "a"))) * self.prefill_cost

    @property
    def decode_rate(self) -> float:
        return self.decodes * self.max_num_seqs / self.stream_seconds

    @property
    def prefill_rate(self) -> float:
        seconds = self.prefill_seconds
        return self.prefills * self.max_num_seqs / seconds if seconds > 0 else math.inf

    @property
    def capacity(self) -> float:
        """Requests a second the fleet can complete."""
        return min(self.decode_rate, self.prefill_rate)

    def describe(self) -> str:
        tokens = len(prompt_tokens(self.body(0, "a")))
        return (
            f"fleet: {self.prefills} prefill + {self.decodes} decode instances, "
            f"max_num_seqs {self.max_num_seqs} each; a stream: {self.tokens} tokens "
            f"{self.token_interval:g} s apart ({self.stream_seconds:.3g} s); a prefill: "
            f"{tokens} tokens x {self.prefill_cost * 1000:g} ms ({self.prefill_seconds:.3g} s)\n"
            f"capacity: {self.capacity:.3g} req/s (decode {self.decodes} x {self.max_num_seqs} "
            f"/ {self.stream_seconds:.3g} s = {self.decode_rate:.3g} req/s; prefill "
            f"{self.prefills} x {self.max_num_seqs} / {self.prefill_seconds:.3g} s = "
            f"{self.prefill_rate:.3g} req/s)"
        )

    def options(self) -> list[str]:
        """This fleet as the command's options (for the child process serving the fakes)."""
        given = [
            *("--prefills", str(self.prefills), "--decodes", str(self.decodes)),
            *("--max-num-seqs", str(self.max_num_seqs), "--tokens", str(self.tokens)),
            *("--token-interval", str(self.token_interval)),
            *("--prefill-cost", str(self.prefill_cost)),
        ]
        if self.max_num_queued_reqs is not None:
            given += ["--max-num-queued-reqs", str(self.max_num_queued_reqs)]
        return given


def serve_fakes(fleet: Fleet) -> None:
    """The fleet's fakes in this process, sharing one ledger; their URLs as a JSON line."""
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    from nixl_twisted.testing import start_cluster

    async def serve() -> None:
        cluster = await start_cluster(
            ["tcp:0:interface=127.0.0.1"] * fleet.prefills,
            ["tcp:0:interface=127.0.0.1"] * fleet.decodes,
            reactor,
            tokens=fleet.tokens,
            token_interval=fleet.token_interval,
            prefill_cost_per_token=fleet.prefill_cost,
            max_num_seqs=fleet.max_num_seqs,
            max_num_queued_reqs=fleet.max_num_queued_reqs,
        )
        urls = {
            "prefill": [fake.url for fake in cluster.prefills],
            "decode": [fake.url for fake in cluster.decodes],
        }
        print(json.dumps(urls), flush=True)

    reactor.callWhenRunning(lambda: ensureDeferred(serve()))
    reactor.run()


@contextmanager
def fakes(fleet: Fleet) -> Iterator[dict[str, list[str]]]:
    command = [sys.executable, "-m", "bench.overload", "--serve-fakes", *fleet.options()]
    with served_fakes(command) as urls:
        yield urls


def _percentile(values: Sequence[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def summary(
    outcomes: Sequence[open_loop.Outcome],
    gauges: open_loop.Gauges,
    window: float,
    capacity: float,
    bound: float,
) -> dict[str, Any]:
    """One load's figures from what each request got and what the engines held."""
    served = [o for o in outcomes if o.served and o.ttft is not None]
    good = [o for o in served if o.ttft is not None and o.ttft <= bound]
    # Goodput counts first tokens that came within the arrival window: at most the
    # fleet's capacity a second, however many arrivals it serves within the bound after.
    on_time = [o for o in good if o.first_at is not None and o.first_at <= window]
    unserved = [o for o in outcomes if not (o.served and o.ttft is not None)]
    ttfts = [o.ttft for o in served if o.ttft is not None]
    count = max(1, len(outcomes))

    def shares(group: Sequence[open_loop.Outcome]) -> dict[str, float]:
        by = Counter(o.tenant for o in group)
        return {t: round(by[t] / len(group), 3) if group else 0.0 for t in TENANTS}

    def waited(role: str) -> dict[str, float]:
        values = gauges.waiting.get(role) or [0.0]
        return {"mean": round(statistics.fmean(values), 1), "max": max(values)}

    return {
        "requests": len(outcomes),
        "served": len(served),
        "goodput": round(len(on_time) / window, 2),
        "goodput_share": round(len(on_time) / window / capacity, 3),
        "ttft_p50_s": _round(_percentile(ttfts, 0.5), 3),  # (ms: a replica's cost is a few)
        "ttft_p99_s": _round(_percentile(ttfts, 0.99), 3),
        "refused": {
            str(status): round(n / count, 3)
            for status, n in sorted(Counter(o.status for o in unserved).items())
        },
        "refusals_with_retry_after": sum(o.retry_after for o in unserved if o.status >= 400),
        "waiting": {role: waited(role) for role in ("decode", "prefill")},
        "served_shares": shares(served),
        "good_shares": shares(good),
        "lag_max_s": _round(max((o.lag for o in outcomes), default=0.0)),
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def measure(
    fleet: Fleet, factor: float, target: Target, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """One load through a target started for it, in front of fakes started for it."""
    rate = factor * fleet.capacity
    planned = open_loop.arrivals(rate, list(TENANTS), seed, fleet.body, args.seconds, args.requests)
    window = args.seconds if args.requests is None else planned[-1].at
    with fakes(fleet) as urls, target.serving(urls) as (url, log):
        log.load_begins()
        began = time.strftime("%H:%M:%S")  # (to read against what else loaded the machine)
        outcomes, gauges, elapsed = asyncio.run(
            open_loop.run(url, planned, urls, TENANT_HEADER, args.client_timeout)
        )
    logged = log.lines_during_load()
    return {
        "load": factor,
        "began": began,
        "offered": round(rate, 2),
        "elapsed_s": round(elapsed, 1),
        **summary(outcomes, gauges, window, fleet.capacity, args.ttft_bound),
        "log_lines": len(logged),
        "log_lines_not_access": sum(b"nixlproxy.access" not in line for line in logged),
        "log_sample": [line.decode("utf-8", "replace").rstrip() for line in logged[-3:]],
    }


def _percent(share: float) -> str:
    return f"{share:.0%}"


def row(result: dict[str, Any], run: int, runs: int) -> str:
    named = {"0": "no answer", "200": "broken"}
    refused = ", ".join(
        f"{named.get(status, status)} {_percent(share)}"
        for status, share in result["refused"].items()
    )
    waiting = result["waiting"]
    label = f"{result['load']:g}x" + (f" (run {run})" if runs > 1 else "")
    cells = [
        label,
        f"{result['offered']:g}/s",
        str(result["requests"]),
        f"{result['goodput']:g}/s ({_percent(result['goodput_share'])})",
        f"{result['ttft_p50_s']} / {result['ttft_p99_s']} s",
        refused or "-",
        str(result["refusals_with_retry_after"]),
        f"{waiting['decode']['mean']:g} / {waiting['decode']['max']:g}",
        f"{waiting['prefill']['mean']:g} / {waiting['prefill']['max']:g}",
        " : ".join(_percent(v) for v in result["served_shares"].values()),
        " : ".join(_percent(v) for v in result["good_shares"].values()),
        f"{result['log_lines']} ({result['log_lines_not_access']})",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| load | offered | requests | goodput (of capacity) | served TTFT p50 / p99 | refused "
    "| with Retry-After | waiting in decode mean / max | in prefill mean / max "
    "| served a : b | within bound a : b | log lines (not access) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float, default=20.0, help="arrivals per load")
    length.add_argument("--requests", type=int, help="instead: this many arrivals per load")
    parser.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS), metavar="X,Y")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run each load N times, seeds --seed, --seed + 1, ..."
    )
    parser.add_argument("--seed", type=int, default=36, help="of the first run's arrivals")
    parser.add_argument("--ttft-bound", type=float, default=5.5, metavar="SECONDS")
    parser.add_argument("--client-timeout", type=float, default=600.0, metavar="SECONDS")
    fleet = parser.add_argument_group("the fakes")
    fleet.add_argument("--prefills", type=int, default=2)
    fleet.add_argument("--decodes", type=int, default=2)
    fleet.add_argument("--max-num-seqs", type=int, default=4)
    fleet.add_argument("--tokens", type=int, default=32)
    fleet.add_argument("--token-interval", type=float, default=0.05, metavar="SECONDS")
    fleet.add_argument("--prefill-cost", type=float, default=0.0005, help="s per prompt token")
    fleet.add_argument("--max-num-queued-reqs", type=int, help="vLLM's 503 past it")
    where = parser.add_argument_group("what serves them")
    where.add_argument(
        "--caps",
        action="store_true",
        help="the proxy with issue 36's options: --decode-max-in-flight and "
        "--prefill-max-in-flight at --max-num-seqs, --queue-size, --queue-timeout, "
        "and the tenants' weights in a --config file",
    )
    where.add_argument("--queue-size", type=int, default=32, help="--caps, vllm-router")
    where.add_argument("--queue-timeout", type=float, default=5.0, metavar="SECONDS")
    where.add_argument(
        "--proxy-arg", action="append", default=[], help="one more twistd nixlproxy option"
    )
    where.add_argument(
        "--vllm-router",
        metavar="PATH",
        help="serve through vllm-project/router's binary instead (P/D mode, with its "
        "queue: --max-concurrent-requests decodes x --max-num-seqs, --queue-size, "
        "--queue-timeout-secs)",
    )
    where.add_argument(
        "--router-arg", action="append", default=[], help="one more vllm-router option"
    )
    parser.add_argument("--json", action="store_true", help="print the raw results too")
    parser.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    return parser


def weights_file(folder: str) -> str:
    """The tenants' weights as the proxy's TOML reads them: ``[tenants.NAME] weight = W``."""
    path = os.path.join(folder, "tenants.toml")
    with open(path, "w", encoding="utf-8") as toml:
        for name, weight in TENANTS.items():
            toml.write(f"[tenants.{name}]\nweight = {weight}\n\n")
    return path


def caps_options(cap: int, queue_size: int, queue_timeout: float, folder: str) -> list[str]:
    """Issue 36's options, both caps at ``cap``, and the tenants' weights (a file in ``folder``)."""
    return [
        *("--decode-max-in-flight", str(cap), "--prefill-max-in-flight", str(cap)),
        *("--queue-size", str(queue_size), "--queue-timeout", f"{queue_timeout:g}"),
        *("--config", weights_file(folder)),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    fleet = Fleet.of(args)
    if args.serve_fakes:
        serve_fakes(fleet)
        return 0
    factors = [float(x) for x in args.loads.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        if args.vllm_router:
            target = vllm_router(
                args.vllm_router,
                fleet.decodes * fleet.max_num_seqs,
                args.queue_size,
                args.queue_timeout,
                args.router_arg,
            )
        else:
            caps = caps_options(fleet.max_num_seqs, args.queue_size, args.queue_timeout, folder)
            extra = [*(caps if args.caps else []), *args.proxy_arg]
            target = nixlproxy(["--tenant-header", TENANT_HEADER, *extra])
        print(fleet.describe())
        print(f"target: {target.name}")
        print(
            f"first-token bound {args.ttft_bound:g} s; tenants "
            f"{' and '.join(TENANTS)} weighted {' : '.join(map(str, TENANTS.values()))}, "
            "sending the same amount\n",
            flush=True,
        )
        print(HEADER, flush=True)
        results = []
        try:
            for factor in factors:
                for run in range(1, args.repeat + 1):
                    # Each run its own arrivals; run N the same for every target.
                    result = measure(fleet, factor, target, args, args.seed + run - 1)
                    results.append(result)
                    print(row(result, run, args.repeat), flush=True)
        except TargetFailed as failed:
            # --caps names options the proxy has only once issue 36 is in.
            print(failed, file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
