"""TTFT and inter-token gaps through proxies in front of a real vLLM prefill/decode pair.

Needs a real vLLM pair (``KEEP=1 bash /work/shared/real-vllm/real-vllm-pd.sh``:
prefill on :8100, decode on :8200, model ``tiny``) and the proxies to compare
already running in front of it, one ``--proxy`` each: say one with the rules
off and one with ``--decode-only-below N``. It is never part of CI (``make
test``, ``.ci/run``): it measures a real engine, for minutes, on a machine
that has one; the suite stays on the fakes. It needs the openai client (the
``demo`` or ``test`` extra).

Each request is a streaming chat completion (``ignore_eos``, so every answer
has ``--max-tokens`` tokens) whose prompt starts with a random number: no two
share a first block, so vLLM's prefix cache serves none of them. The sides
take turns, so that whatever else loads the machine hits them alike: with
``--concurrency 1`` request by request; above, block by block (``--block``
requests to one side, ``--concurrency`` at a time, then the next side),
because concurrent requests to both sides would share the decode instance
and blur what each mode costs the other streams. Prompt length is aimed at
``--prompt-tokens`` (vLLM's count, from ``usage``): the warm-up requests,
not measured, vary in length to fit tokens per word and the template's
fixed part.

Prints, per proxy: the proxy's disaggregation decisions during the run,
warm-up included (from its ``/metrics``), prompt tokens, TTFT p50/p90/p99
(vLLM's first token chunk as the client sees it; not the role's chunk
before it) and the gaps between token chunks p50/p99.

    python -m bench.real_ttft --proxy http://127.0.0.1:8000 --proxy http://127.0.0.1:8001
    python -m bench.real_ttft --proxy ... --proxy ... --prompt-tokens 600 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from openai import AsyncOpenAI

#: Words of the tiny model's tokenizer corpus, so that a word is a token or two, not ten.
WORDS = (
    *("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"),
    *("tiny", "test", "model", "for", "lorem", "ipsum", "dolor", "sit", "amet", "elit"),
)

DECISIONS = "nixlproxy_disaggregation_decisions_total{"


@dataclass
class Side:
    """One proxy and what its measured requests saw."""

    url: str
    client: AsyncOpenAI
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warmup_errors: list[str] = field(default_factory=list)


@dataclass
class Prompts:
    """Distinct prompts of about ``target`` tokens, as vLLM counts them.

    tokens = ``fixed`` (template, random number) + ``per_word`` x words, fitted
    by least squares on the warm-up requests' usage, whose word counts vary
    on purpose (a ratio alone would count the fixed part as words).
    """

    target: int
    rng: random.Random
    fixed: float = 16.0
    per_word: float = 1.0
    seen: list[tuple[int, int]] = field(default_factory=list)

    def make(self, calibrating: bool) -> tuple[str, int]:
        words = (self.target - self.fixed) / self.per_word
        if calibrating:
            words *= self.rng.uniform(0.75, 1.25)
        count = max(1, round(words))
        text = f"{self.rng.randrange(10**9)} " + " ".join(self.rng.choices(WORDS, k=count))
        return text, count

    def learn(self, words: int, tokens: int) -> None:
        self.seen.append((words, tokens))
        if len({w for w, _ in self.seen}) < 2:
            return
        xs, ys = [float(w) for w, _ in self.seen], [float(t) for _, t in self.seen]
        slope, intercept = statistics.linear_regression(xs, ys)
        if slope > 0:
            self.per_word, self.fixed = slope, intercept


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest rank: with 60 samples p99 is the largest."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def decisions(url: str) -> dict[str, float]:
    """The proxy's ``nixlproxy_disaggregation_decisions_total`` samples, by their labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(DECISIONS):
            labels, _, value = line.rpartition(" ")
            found[labels[len(DECISIONS) - 1 :]] = float(value)
    return found


async def one_request(
    side: Side, prompts: Prompts, model: str, max_tokens: int, record: bool
) -> None:
    text, words = prompts.make(calibrating=not record)
    started = time.perf_counter()
    chunk_times: list[float] = []
    usage_tokens: int | None = None
    try:
        stream = await side.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            # One chunk a token, after the role's chunk; its text may be "" (a
            # token that ends mid-character under a byte-level tokenizer).
            if chunk.choices and chunk.choices[0].delta.role is None:
                chunk_times.append(time.perf_counter())
            if chunk.usage is not None:
                usage_tokens = chunk.usage.prompt_tokens
    except Exception as error:
        (side.errors if record else side.warmup_errors).append(f"{type(error).__name__}: {error}")
        return
    if not record:
        if usage_tokens is not None:
            prompts.learn(words, usage_tokens)
        return
    if not chunk_times:
        side.errors.append("no token chunk")
        return
    side.ttfts.append(chunk_times[0] - started)
    side.gaps.extend(b - a for a, b in itertools.pairwise(chunk_times))
    if usage_tokens is not None:
        side.prompt_tokens.append(usage_tokens)


async def block(
    side: Side,
    count: int,
    concurrency: int,
    prompts: Prompts,
    args: argparse.Namespace,
    record: bool,
) -> None:
    """``count`` requests to one side, ``concurrency`` at a time (closed loop)."""
    left = count

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one_request(side, prompts, args.model, args.max_tokens, record)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))


async def measure(args: argparse.Namespace) -> list[Side]:
    sides = [
        Side(url, AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=300))
        for url in args.proxy
    ]
    prompts = Prompts(args.prompt_tokens, random.Random(args.seed))
    size = args.block or (1 if args.concurrency == 1 else 4 * args.concurrency)
    for phase, total, record in (("warm-up", args.warmup, False), ("measure", args.requests, True)):
        done = 0
        while done < total:
            count = min(size, total - done)
            for side in sides:
                await block(side, count, args.concurrency, prompts, args, record)
            done += count
        failed = sum(len(side.warmup_errors if not record else side.errors) for side in sides)
        print(
            f"{phase}: {total} per side, {failed} failed; prompt tokens ~ {prompts.fixed:.1f} "
            f"+ {prompts.per_word:.2f} x words"
        )
    for side in sides:
        await side.client.close()
    return sides


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--proxy", action="append", required=True, help="a proxy's base URL")
    parser.add_argument("--requests", type=int, default=60, help="measured requests per proxy")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured requests per proxy")
    parser.add_argument("--prompt-tokens", type=int, default=30, help="each prompt's aim")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    parser.add_argument("--block", type=int, default=0, help="requests per turn (0: auto)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    before = {url: decisions(url) for url in args.proxy}
    sides = asyncio.run(measure(args))
    print(
        f"\nstreaming chat, max_tokens {args.max_tokens}, concurrency {args.concurrency}, "
        f"{args.requests} measured per proxy (after {args.warmup} warm-up)\n"
    )
    print(
        "| proxy | decisions (run, warm-up too) | prompt tokens | TTFT p50 ms | p90 | p99 "
        "| gap p50 ms | gap p99 | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    summary = []
    for side in sides:
        after = decisions(side.url)
        made = {k: v - before[side.url].get(k, 0.0) for k, v in after.items()}
        said = ", ".join(f"{k} {v:g}" for k, v in sorted(made.items()) if v) or "-"
        counts = side.prompt_tokens
        tokens = f"{statistics.mean(counts):.0f} ({min(counts)}-{max(counts)})" if counts else "-"
        row = [
            side.url,
            said,
            tokens,
            *(ms(percentile(side.ttfts, q)) for q in (50, 90, 99)),
            *(ms(percentile(side.gaps, q)) for q in (50, 99)),
            str(len(side.errors)),
        ]
        print("| " + " | ".join(row) + " |")
        summary.append({"proxy": side.url, "decisions": made, "errors": side.errors[:3]})
    print("\n" + json.dumps(summary))


if __name__ == "__main__":
    main()
