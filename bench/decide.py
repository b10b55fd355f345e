"""Conditional disaggregation on a mixed workload: what skipping prefill buys, and what it costs.

The workload (seeded by ``--seed``): ``--requests`` streaming chat requests,
``--concurrency`` at a time, through ``twistd nixlproxy`` (core 0):

- 70 % short prompts, 30 to 100 tokens each;
- 15 % long prompts, 1,500 to 3,000 tokens each;
- the rest turns of multi-turn conversations of ``--turns`` turns: a shared
  system prompt and a first message of 200 to 400 tokens, then each turn
  repeats the whole history (its answers included) and adds 50 to 100
  tokens; a conversation's turns run one after the other (``bench.mixed``).

A token is four bytes of text, as the proxy estimates a prompt and as the
fakes count one. The fakes (``nixl_twisted.testing.FakeVLLM``, one process
pinned off the proxy's core, one shared ledger) are 2 prefill and 2 decode
instances: each computes an uncached prompt token in ``--cost`` seconds (a
decode instance too, when it is sent a prompt without
``kv_transfer_params``); a decode instance's streams stall while it computes
(``computing_stalls_streams``), a decode leg pulls its KV in
``--kv-latency`` plus ``--kv-cost`` per prompt token, and tokens come
``--token-interval`` apart. Each run prints, as the client saw them: TTFT
p50 / p99 of the short prompts, of the long ones and of the conversations'
turns (the fakes' first token comes one token interval after the role's
chunk, in every run alike); the gap between consecutive tokens of a
stream, p50 / p99; the share of requests the proxy served decode-only (its
``nixlproxy_disaggregation_decisions_total``; ``-`` when it has no such
metric); failed requests. The runs (``--only a,b`` picks some; ``--json``
prints each run's figures, the decisions included, as JSON):

- ``a``: no rule, every request prefilled then decoded (P/D);
- ``b``: ``--decode-only-below 256``: short prompts skip prefill;
- ``c``: ``--decode-only-below 4096``: every prompt computed on a decode
  instance, which stalls that instance's other streams;
- ``d0``: the prefill instances 4x slower, no rule (the baseline of ``d``);
- ``d``: the same, ``--decode-only-busy-below 512 --prefill-busy-at 2``;
- ``e``: one of the two prefill instances answers 503 to every request,
  ``--prefill-fallback decode --prefill-retries 0``: what fell on it goes
  decode-only instead of failing;
- ``e2``: no prefill instance listens at all, ``--prefill-fallback decode``.

    python -m bench.decide [--requests 200] [--concurrency 8] [--only a,b,c]

A run the proxy refuses to start (an option it does not have) prints
``not run`` and twistd's reason, and the command exits 1 after the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from bench.mixed import drive, percentile, workload
from bench.routing_run import _get, _samples
from bench.run import _free_port, nixlproxy, served_fakes
from nixl_twisted.testing.process import TwistdFailed

DECISIONS = "nixlproxy_disaggregation_decisions_total"


@dataclass(frozen=True)
class Run:
    key: str
    name: str
    #: The proxy's options besides its instances.
    args: tuple[str, ...] = ()
    #: The prefill instances compute this many times slower than ``--cost``.
    prefill_factor: float = 1.0
    #: Prefill instances that answer 503 to every generation request.
    refusing_prefills: int = 0
    #: No prefill instance listens: the proxy is given ports nothing serves.
    prefills_down: bool = False


RUNS = (
    Run("a", "rules off (always P/D)"),
    Run("b", "--decode-only-below 256", ("--decode-only-below", "256")),
    Run("c", "--decode-only-below 4096 (all decode-only)", ("--decode-only-below", "4096")),
    Run("d0", "prefill 4x slower, rules off", prefill_factor=4),
    Run(
        "d",
        "prefill 4x slower, --decode-only-busy-below 512 --prefill-busy-at 2",
        ("--decode-only-busy-below", "512", "--prefill-busy-at", "2"),
        prefill_factor=4,
    ),
    Run(
        "e",
        "one prefill answers 503, --prefill-fallback decode --prefill-retries 0",
        ("--prefill-fallback", "decode", "--prefill-retries", "0"),
        refusing_prefills=1,
    ),
    Run(
        "e2",
        "every prefill down, --prefill-fallback decode",
        ("--prefill-fallback", "decode"),
        prefills_down=True,
    ),
)


# -- the fakes, served by a child process ----------------------------------------


@dataclass(frozen=True)
class Fakes:
    """What the fakes' process serves (passed to it as JSON)."""

    prefills: int
    decodes: int
    cost: float
    prefill_factor: float
    refusing_prefills: int
    refusals: int
    kv_cost: float
    kv_latency: float
    token_interval: float
    tokens: int


def serve_fakes(spec: Fakes) -> None:
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    from nixl_twisted.testing import ErrorAnswer, FakeVLLM, TransferLedger

    async def serve() -> None:
        ledger = TransferLedger()
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        for i in range(spec.prefills):
            fake = FakeVLLM(
                name=f"prefill-{i}",
                ledger=ledger,
                tokens=spec.tokens,
                prefill_cost_per_token=spec.cost * spec.prefill_factor,
            )
            if i < spec.refusing_prefills:
                # Healthy to GET /health, refusing every request: health checks cannot tell.
                fake.script(*[ErrorAnswer(status=503, message="overloaded")] * spec.refusals)
            urls["prefill"].append(await fake.listen("tcp:0:interface=127.0.0.1", reactor))
        for i in range(spec.decodes):
            fake = FakeVLLM(
                name=f"decode-{i}",
                ledger=ledger,
                tokens=spec.tokens,
                token_interval=spec.token_interval,
                prefill_cost_per_token=spec.cost,
                computing_stalls_streams=True,
                kv_load_cost_per_token=spec.kv_cost,
                kv_load_latency=spec.kv_latency,
            )
            urls["decode"].append(await fake.listen("tcp:0:interface=127.0.0.1", reactor))
        print(json.dumps(urls), flush=True)

    reactor.callWhenRunning(lambda: ensureDeferred(serve()))
    reactor.run()


@contextmanager
def fakes(spec: Fakes) -> Iterator[dict[str, list[str]]]:
    command = [sys.executable, "-m", "bench.decide", "--serve-fakes", json.dumps(asdict(spec))]
    with served_fakes(command) as urls:
        yield urls


def decisions(metrics: str) -> dict[str, float] | None:
    """The proxy's decisions summed by ``decision`` (None: it has no such metric)."""
    samples = _samples(metrics, DECISIONS)
    if not samples:
        return None
    summed: dict[str, float] = {}
    for labels, value in samples:
        found = re.search(r'decision="([^"]+)"', labels)
        decision = found.group(1) if found else "?"
        summed[decision] = summed.get(decision, 0.0) + value
    return summed


# -- a run -----------------------------------------------------------------------


def measure(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """One run's row; ``not_run`` says why when the proxy refused to start."""
    work = workload(args.requests, args.turns, args.seed)
    spec = Fakes(
        prefills=0 if run.prefills_down else 2,
        decodes=2,
        cost=args.cost,
        prefill_factor=run.prefill_factor,
        refusing_prefills=run.refusing_prefills,
        refusals=len(work.jobs),
        kv_cost=args.kv_cost,
        kv_latency=args.kv_latency,
        token_interval=args.token_interval,
        tokens=args.tokens,
    )
    row: dict[str, Any] = {"run": f"{run.key}: {run.name}"}
    with fakes(spec) as urls:
        prefills = urls["prefill"] or [f"http://127.0.0.1:{_free_port()}" for _ in range(2)]
        proxy_args = [
            "--health-interval",
            "1",
            "--access-log",
            "off",
            *[a for u in prefills for a in ("--prefill", u)],
            *[a for u in urls["decode"] for a in ("--decode", u)],
            *run.args,
        ]
        try:
            with nixlproxy(proxy_args, "0") as (_, url):
                measured = asyncio.run(drive(url, work, args.concurrency, args.tokens))
                decided = decisions(asyncio.run(_get(url + "/metrics")))
        except TwistdFailed as failed:
            # twistd's last line says why, after its own command line: "... -n: option ..."
            said = [line for line in str(failed).splitlines() if line.strip()]
            why = said[-1].split(": ", 1)[-1] if said else "the proxy did not start"
            return row | {"not_run": why}
    total = sum(decided.values()) if decided else 0
    row |= {
        "requests": len(work.jobs),
        "failures": measured.failures,
        "decisions": decided,
        "decode_only_share": (decided.get("decode_only", 0) / total) if decided and total else None,
    }
    for kind, values in measured.ttfts.items():
        row[f"{kind}_ttft_ms"] = [_ms(percentile(values, q)) for q in (0.5, 0.99)]
    row["gap_ms"] = [_ms(percentile(measured.gaps, q), 2) for q in (0.5, 0.99)]
    return row


def _ms(seconds: float | None, digits: int = 1) -> float | None:
    return None if seconds is None else round(seconds * 1000, digits)


def _pair(values: list[float | None]) -> str:
    return "-" if values[0] is None else f"{values[0]} / {values[1]} ms"


HEADER = (
    "| run | short TTFT p50 / p99 | long TTFT p50 / p99 | turn TTFT p50 / p99 "
    "| gap p50 / p99 | decode-only | failed |\n|---|---|---|---|---|---|---|"
)


def table_row(row: dict[str, Any]) -> str:
    if "not_run" in row:
        cells = [row["run"], "-", "-", "-", "-", "-", f"not run: {row['not_run']}"]
    else:
        share = row["decode_only_share"]
        cells = [
            row["run"],
            _pair(row["short_ttft_ms"]),
            _pair(row["long_ttft_ms"]),
            _pair(row["turn_ttft_ms"]),
            _pair(row["gap_ms"]),
            "-" if share is None else f"{share:.1%}",
            str(row["failures"]),
        ]
    return "| " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per run, about")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="turns of each conversation")
    parser.add_argument("--cost", type=float, default=0.0001, help="s per uncached token")
    parser.add_argument("--kv-cost", type=float, default=0.00001, help="s per token pulled")
    parser.add_argument("--kv-latency", type=float, default=0.002, help="s per KV pull")
    # 10 ms, not 5: the client parses every chunk with the openai client, on the
    # fakes' core; half the chunks keep it from blurring the gaps it measures.
    parser.add_argument("--token-interval", type=float, default=0.01, help="s between tokens")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", default="", help="the runs' keys, comma-separated: a,b,c")
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead")
    parser.add_argument("--serve-fakes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_fakes:
        serve_fakes(Fakes(**json.loads(args.serve_fakes)))
        return 0
    keys = {key.strip() for key in args.only.split(",") if key.strip()}
    unknown = keys - {run.key for run in RUNS}
    if unknown:
        parser.error(f"no run {', '.join(sorted(unknown))}: the runs are a, b, c, d0, d, e, e2")
    if not args.json:
        print(HEADER, flush=True)
    not_run = 0
    for run in RUNS:
        if keys and run.key not in keys:
            continue
        row = measure(run, args)
        not_run += "not_run" in row
        print(json.dumps(row) if args.json else table_row(row), flush=True)
    if not_run:
        print(f"{not_run} run(s) not run: the proxy refused their options", file=sys.stderr)
    return 1 if not_run else 0


if __name__ == "__main__":
    raise SystemExit(main())
