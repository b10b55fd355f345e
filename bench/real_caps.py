"""Many long generations at once through proxies in front of one real vLLM prefill/decode pair.

Issue 36's check on a real engine: with each instance started with a small
``--max-num-seqs`` (2, say), 16 clients each streaming a long answer, does
the proxy keep the waiting in its own queue rather than inside decode (where
prefill holds each waiting request's KV blocks and no other instance can take
it)? Start the pair with ``--max-num-seqs 2`` (as ``real-vllm-pd.sh``'s
``start`` does, the flag changed), then the proxies to compare in front of it,
say one without caps and one with ``--prefill-max-in-flight 2
--decode-max-in-flight 2``, one ``--proxy`` each. It is never part of CI: it
measures a real engine, for minutes. It needs the openai client (the
``demo`` or ``test`` extra).

Every request is a streaming chat completion (``ignore_eos``: every answer
has ``--max-tokens`` tokens) whose prompt opens with a random number, so no
two share a cached block. The proxies take turns, one whole run each. While a
run goes, each engine's ``/metrics`` is read every ``--every`` seconds.

Prints, per proxy: requests served and failed, TTFT p50/p99/max (the first
token chunk as the client sees it), the run's wall time and tokens per
second, decode's ``vllm:num_requests_waiting`` (most and mean of the
samples) and most running, prefill's most waiting, and over the run the
growth of ``vllm:nixl_num_kv_expired_reqs_total`` (prefill's KV leases that
ran out), ``vllm:num_preemptions_total`` and decode's prompt tokens by
source (pulled over NIXL, or computed there: a prompt recomputed on decode
shows as computed tokens).

    python -m bench.real_caps --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --proxy http://127.0.0.1:8000 --proxy http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from openai import AsyncOpenAI

from bench.real_ttft import Prompts, ms, percentile

#: The engine gauges and counters a run watches, by the name vLLM 0.32 exports.
WATCHED = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:num_preemptions_total",
)


#: Prompt tokens by where they came from (``local_compute``, ``external_kv_transfer``, ...).
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def engine_metrics(url: str) -> dict[str, float]:
    """The watched samples of one engine, summed over its labels (engines, ranks)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = dict.fromkeys(WATCHED, 0.0)
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in found:
            found[name] += float(rest.rpartition(" ")[2])
        elif name == BY_SOURCE:  # (one key per source: what decode pulled, what it computed)
            source = rest.partition('source="')[2].partition('"')[0]
            key = f"{BY_SOURCE}:{source}"
            found[key] = found.get(key, 0.0) + float(rest.rpartition(" ")[2])
    return found


@dataclass
class Run:
    """One proxy's run and what the engines said during it."""

    url: str
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    samples: list[tuple[dict[str, float], dict[str, float]]] = field(default_factory=list)


async def sample(run: Run, prefill: str, decode: str, every: float, done: asyncio.Event) -> None:
    while not done.is_set():
        pair = await asyncio.gather(
            asyncio.to_thread(engine_metrics, prefill), asyncio.to_thread(engine_metrics, decode)
        )
        run.samples.append((pair[0], pair[1]))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), every)


async def one_request(
    run: Run, client: AsyncOpenAI, prompts: Prompts, args: argparse.Namespace
) -> None:
    text, _ = prompts.make(calibrating=False)
    started = time.perf_counter()
    first: float | None = None
    try:
        stream = await client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": text}],
            stream=True,
            max_tokens=args.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.role is None:
                first = first or time.perf_counter()
                run.tokens += 1
    except Exception as error:
        run.errors.append(f"{type(error).__name__}: {error}")
        return
    if first is None:
        run.errors.append("no token chunk")
        return
    run.ttfts.append(first - started)


async def measure(url: str, args: argparse.Namespace) -> Run:
    run = Run(url)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    prompts = Prompts(args.prompt_tokens, random.Random(args.seed))
    before = await asyncio.to_thread(engine_metrics, args.prefill)
    before_decode = await asyncio.to_thread(engine_metrics, args.decode)
    done = asyncio.Event()
    sampler = asyncio.create_task(sample(run, args.prefill, args.decode, args.every, done))
    started = time.perf_counter()

    async def client_loop() -> None:
        for _ in range(args.per_client):
            await one_request(run, client, prompts, args)

    await asyncio.gather(*(client_loop() for _ in range(args.clients)))
    run.wall = time.perf_counter() - started
    done.set()
    await sampler
    after = await asyncio.to_thread(engine_metrics, args.prefill)
    after_decode = await asyncio.to_thread(engine_metrics, args.decode)
    run.samples.append((before, before_decode))
    run.samples.append((after, after_decode))
    await client.close()
    return run


def summary(run: Run) -> dict[str, object]:
    first, last = run.samples[-2], run.samples[-1]
    decode_waiting = [d["vllm:num_requests_waiting"] for _, d in run.samples[:-2]] or [0.0]
    return {
        "proxy": run.url,
        "served": len(run.ttfts),
        "failed": len(run.errors),
        "ttft_p50_ms": ms(percentile(run.ttfts, 50)),
        "ttft_p99_ms": ms(percentile(run.ttfts, 99)),
        "ttft_max_ms": ms(max(run.ttfts, default=None)),
        "wall_s": round(run.wall, 1),
        "tokens_per_s": round(run.tokens / run.wall, 1) if run.wall else 0.0,
        "decode_waiting_max": max(decode_waiting),
        "decode_waiting_mean": round(statistics.mean(decode_waiting), 2),
        "decode_running_max": max(d["vllm:num_requests_running"] for _, d in run.samples),
        "prefill_waiting_max": max(p["vllm:num_requests_waiting"] for p, _ in run.samples),
        "prefill_kv_expired": last[0]["vllm:nixl_num_kv_expired_reqs_total"]
        - first[0]["vllm:nixl_num_kv_expired_reqs_total"],
        "preemptions": sum(
            last[i]["vllm:num_preemptions_total"] - first[i]["vllm:num_preemptions_total"]
            for i in (0, 1)
        ),
        "decode_pulled": _grew(first[1], last[1], "external_kv_transfer"),
        "decode_computed": _grew(first[1], last[1], "local_compute"),
        "samples": len(run.samples) - 2,
        "errors": run.errors[:3],
    }


def _grew(first: dict[str, float], last: dict[str, float], source: str) -> int:
    """How many prompt tokens of ``source`` an engine counted over the run."""
    key = f"{BY_SOURCE}:{source}"
    return round(last.get(key, 0.0) - first.get(key, 0.0))


COLUMNS = (
    ("proxy", "proxy"),
    ("served", "served"),
    ("failed", "failed"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "p99"),
    ("ttft_max_ms", "max"),
    ("wall_s", "wall s"),
    ("tokens_per_s", "tokens/s"),
    ("decode_waiting_max", "decode waiting max"),
    ("decode_waiting_mean", "mean"),
    ("decode_running_max", "decode running max"),
    ("prefill_waiting_max", "prefill waiting max"),
    ("prefill_kv_expired", "KV leases expired"),
    ("preemptions", "preemptions"),
    ("decode_pulled", "decode prompt tokens pulled"),
    ("decode_computed", "computed"),
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--proxy", action="append", required=True, help="a proxy's base URL")
    parser.add_argument("--prefill", required=True, help="the prefill engine's base URL")
    parser.add_argument("--decode", required=True, help="the decode engine's base URL")
    parser.add_argument("--clients", type=int, default=16, help="requests in flight")
    parser.add_argument("--per-client", type=int, default=2, help="requests each client sends")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="each prompt's aim")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    runs = [asyncio.run(measure(url, args)) for url in args.proxy]
    print(
        f"\n{args.clients} clients x {args.per_client} streaming chats, ~{args.prompt_tokens} "
        f"prompt tokens, {args.max_tokens} tokens each\n"
    )
    print("| " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    rows = [summary(run) for run in runs]
    for row in rows:
        print("| " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |")
    print("\n" + json.dumps(rows))


if __name__ == "__main__":
    main()
